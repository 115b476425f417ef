{{/* Names, labels and the values several templates derive. */}}

{{- define "strata.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's full name; component objects append "-router", "-prefill", ... so it stays under 50. */}}
{{- define "strata.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Selector labels of one component: call with (dict "root" $ "component" "router"). */}}
{{- define "strata.selectorLabels" -}}
app.kubernetes.io/name: {{ include "strata.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "strata.labels" -}}
{{ include "strata.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: strata
{{- end }}

{{- define "strata.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "strata.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "strata.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "strata.clusterSecretName" -}}
{{- default (printf "%s-cluster-secret" (include "strata.fullname" .)) .Values.clusterSecret.existingSecret }}
{{- end }}

{{- define "strata.apiKeysSecretName" -}}
{{- default (printf "%s-api-keys" (include "strata.fullname" .)) .Values.router.apiKeys.existingSecret }}
{{- end }}

{{- define "strata.s3SecretName" -}}
{{- default (printf "%s-s3" (include "strata.fullname" .)) .Values.s3.existingSecret }}
{{- end }}

{{/* Whether the router reads API keys, and whether S3 credentials come from a Secret. */}}
{{- define "strata.apiKeysEnabled" -}}
{{- if or .Values.router.apiKeys.keys .Values.router.apiKeys.existingSecret }}true{{ end }}
{{- end }}

{{- define "strata.s3CredentialsEnabled" -}}
{{- if or .Values.s3.existingSecret .Values.s3.accessKeyId }}true{{ end }}
{{- end }}

{{/* The Redis URL the workers get from the ConfigMap ("" when none, or when it comes from a Secret). */}}
{{- define "strata.redisUrl" -}}
{{- if .Values.redis.url }}
{{- .Values.redis.url }}
{{- else if and .Values.redis.enabled (not .Values.redis.existingSecret) }}
{{- printf "redis://%s-redis:6379/0" (include "strata.fullname" .) }}
{{- end }}
{{- end }}

{{- define "strata.bundledRedis" -}}
{{- if and .Values.redis.enabled (not .Values.redis.url) (not .Values.redis.existingSecret) }}true{{ end }}
{{- end }}

{{/* /dev/shm's size: given, or host tier + hand-off region + headroom. Call with (dict "root" $ "role" "prefill"). */}}
{{- define "strata.shmSizeLimit" -}}
{{- $w := .root.Values.workers }}
{{- if $w.shm.sizeLimit }}
{{- $w.shm.sizeLimit }}
{{- else }}
{{- $handoff := ternary (int .root.Values.prefill.handoffMiB) 0 (eq .role "prefill") }}
{{- printf "%dMi" (add (int $w.hostTierMiB) $handoff (int $w.shm.headroomMiB)) }}
{{- end }}
{{- end }}

{{- define "strata.diskSizeLimit" -}}
{{- $w := .root.Values.workers }}
{{- if $w.disk.sizeLimit }}
{{- $w.disk.sizeLimit }}
{{- else }}
{{- printf "%dGi" (mul 11 (int (index .root.Values .role).expertParallel)) }}
{{- end }}
{{- end }}

{{/* The pod and container security settings every Strata container runs with (the image's uid 10001). */}}
{{- define "strata.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "strata.containerSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
allowPrivilegeEscalation: false
readOnlyRootFilesystem: false
capabilities:
  drop: [ALL]
{{- end }}

{{/* Env every Strata container gets: the ConfigMap (referenced as $(STRATA_CFG_*) in args) and the fleet secret. */}}
{{- define "strata.commonEnv" -}}
envFrom:
  - configMapRef:
      name: {{ include "strata.fullname" . }}-config
env:
  - name: STRATA_CLUSTER_SECRET
    valueFrom:
      secretKeyRef:
        name: {{ include "strata.clusterSecretName" . }}
        key: {{ .Values.clusterSecret.key }}
{{- end }}

{{/* podAntiAffinity from a preset ("soft" or "hard") over one component's pods. */}}
{{- define "strata.affinity" -}}
{{- $values := index .root.Values .component }}
{{- if $values.affinity }}
{{- toYaml $values.affinity }}
{{- else if eq $values.antiAffinity "hard" }}
podAntiAffinity:
  requiredDuringSchedulingIgnoredDuringExecution:
    - topologyKey: kubernetes.io/hostname
      labelSelector:
        matchLabels:
          {{- include "strata.selectorLabels" . | nindent 10 }}
{{- else if eq $values.antiAffinity "soft" }}
podAntiAffinity:
  preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      podAffinityTerm:
        topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels:
            {{- include "strata.selectorLabels" . | nindent 12 }}
{{- end }}
{{- end }}

{{/* What values.schema.json cannot say (it checks one field at a time): fail with a message naming the fields. */}}
{{- define "strata.validate" -}}
{{- $r := .Values.router }}
{{- $router := list (int $r.grpcPort) (int $r.httpPort) (int $r.registryPort) }}
{{- if ne (len (uniq $router)) 3 }}
{{- fail (printf "router.grpcPort, router.httpPort and router.registryPort must differ, got %v" $router) }}
{{- end }}
{{- $w := .Values.workers }}
{{- $workers := list (int $w.port) (int $w.metricsPort) (int $w.kvEventsPort) (int $w.kvReplayPort) }}
{{- if ne (len (uniq $workers)) 4 }}
{{- fail (printf "workers.port, workers.metricsPort, workers.kvEventsPort and workers.kvReplayPort must differ, got %v" $workers) }}
{{- end }}
{{- range $role := list "prefill" "decode" }}
{{- $a := (index $.Values $role).autoscaling }}
{{- if and $a.enabled (gt (int $a.minReplicas) (int $a.maxReplicas)) }}
{{- fail (printf "%s.autoscaling.minReplicas (%d) must not exceed its maxReplicas (%d)" $role (int $a.minReplicas) (int $a.maxReplicas)) }}
{{- end }}
{{- end }}
{{- if and $r.apiKeys.keys $r.apiKeys.existingSecret }}
{{- fail "router.apiKeys: give keys or existingSecret, not both" }}
{{- end }}
{{- if and .Values.s3.accessKeyId .Values.s3.existingSecret }}
{{- fail "s3: give accessKeyId/secretAccessKey or existingSecret, not both" }}
{{- end }}
{{- if and .Values.s3.accessKeyId (not .Values.s3.url) }}
{{- fail "s3.accessKeyId is set but s3.url is empty: the credentials would serve no tier" }}
{{- end }}
{{- end }}

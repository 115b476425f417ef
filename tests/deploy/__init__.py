"""Tests of deploy/: the container image and the Helm chart, checked without a cluster or a Docker daemon."""

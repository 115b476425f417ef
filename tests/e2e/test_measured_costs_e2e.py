"""The router's cost model is calibrated from what the workers measure (issue 17 item 3): after disaggregated
requests, the decode worker's heartbeats carry its measured KV hand-off reads (`transfer_read_*`) and the prefill
worker's its prefill rate, which the router turns into `MeasuredCosts` for routing."""
from __future__ import annotations

import time

import pytest

from router.service import measured_from_proto
from strata.client import StrataClient

pytestmark = pytest.mark.slow


def test_workers_report_measured_transfer_and_prefill_costs(cluster):
    with StrataClient(cluster.grpc_address, timeout_s=120) as client:
        for i in range(3):   # longer than the local-prefill bound: prefilled on the prefill worker, handed off
            out = client.generate(f"measured costs {i} " + "lorem ipsum dolor sit amet " * 12, max_tokens=2,
                                  include_metrics=True)
            assert out.metrics.disaggregated and out.metrics.blocks_transferred > 0
        deadline = time.monotonic() + 30   # heartbeats carry the figures, read at most once a second
        while time.monotonic() < deadline and client.workers(role="decode")[0].load.transfer_read_samples < 3:
            time.sleep(0.5)
        decode = client.workers(role="decode")[0].load
        prefill = client.workers(role="prefill")[0].load
    assert decode.transfer_read_samples >= 3 and decode.transfer_read_bytes_per_s > 0
    measured = measured_from_proto(decode)
    assert measured is not None and measured.transfer is not None
    assert prefill.transfer_read_samples == 0          # a prefill worker reads no hand-offs
    assert prefill.prefill_rate_samples > 0 and prefill.prefill_tokens_per_s > 0

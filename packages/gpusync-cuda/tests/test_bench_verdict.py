"""The latency bench's verdict lines (no GPU): both readings against floor + target, and the in-graph
service reading only where the run measured it."""
from gpusync_cuda.bench import TARGETS, verdict


def _res(kernel_mean, service=None):
    r = {"path": "kernel", "batch": 1, "cpu_routes": "1/token", "us_per_layer_median": 20.0,
         "us_per_layer_mean": kernel_mean}
    if service is not None:
        r["cpu_service_us_per_layer"] = service
    return {"floor": {"roundtrip": {"us_per_op_median": 5.0}}, "cpu_task_us": {1: {"task": 13.0}},
            "results": [r, {"path": "kernel", "batch": 8, "cpu_routes": "1/token", "us_per_layer_median": 1.0,
                            "us_per_layer_mean": 1.0}]}


def test_task_reading_only_without_service():
    res = _res(21.0)
    lines = verdict(res)
    assert len(lines) == 1 and "NOT MET" in lines[0]  # 20 - 13 = 7 > 5 + 1.5
    assert res["results"][0]["minus_task_us"] == 7.0 and res["results"][0]["target_us"] == 5.0 + TARGETS["kernel"]
    assert "minus_service_us" not in res["results"][0]


def test_service_reading_met_and_not_met():
    res = _res(21.0, service=15.0)  # 21 - 15 = 6 <= 6.5
    lines = verdict(res)
    assert len(lines) == 2 and lines[1].endswith("MET (-0.50 us)") and res["results"][0]["minus_service_us"] == 6.0
    lines = verdict(_res(21.0, service=14.0))  # 7 > 6.5
    assert "NOT MET (+0.50 us)" in lines[1]


def test_no_floor_says_so():
    res = _res(21.0, 15.0)
    res["floor"] = {}
    assert verdict(res) == ["verdict: no memop floor or no batch-1 CPU task in this run"]

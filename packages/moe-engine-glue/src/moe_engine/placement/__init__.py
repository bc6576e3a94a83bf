"""Expert placement: routing traces (trace.py), placement policies (policies.py), their simulation (simulate.py),
the trace model's calibration (calibrate.py) and the hit-rate report (report.py)."""

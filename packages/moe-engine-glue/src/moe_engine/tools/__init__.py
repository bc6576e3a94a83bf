"""The moe-engine command line and what it runs: demo, info, benchmarks, model shape presets. Nothing in the runtime
modules imports these."""

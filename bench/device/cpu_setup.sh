# Sourced from the repo root, after OUT is set, by ab_executor.sh, device_*.sh and kernel_sweep.sh (bench/device/).
# Installs the wheels the image lacks (.whl/) into /tmp/site, writes lscpu into $OUT, builds cpumoe-formats and
# cpumoe-executor in place (log: $OUT/build.log; on failure prints its tail and exits 1) and puts their source trees
# on PYTHONPATH.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site
lscpu > "$OUT/lscpu.txt"
(cd packages/cpumoe-formats && python3 hatch_build.py) > "$OUT/build.log" 2>&1 \
  && (cd packages/cpumoe-executor && PYTHONPATH=../cpumoe-formats/src:/tmp/site python3 hatch_build.py) >> "$OUT/build.log" 2>&1 \
  || { tail -30 "$OUT/build.log"; echo "build failed"; exit 1; }
export PYTHONPATH=$PWD/packages/cpumoe-formats/src:$PWD/packages/cpumoe-executor/src:/tmp/site

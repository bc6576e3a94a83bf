# Sourced by the CPU-side scripts for the lent GPU host (ci/device_cpu.sh, device_batch.sh, device_mxfp4.sh,
# kernel_sweep.sh) from the repo root after they set OUT: the wheels the image lacks (.whl/) into /tmp/site,
# lscpu into $OUT, cpumoe-formats and cpumoe-executor built in place (log: $OUT/build.log; on failure its tail is
# printed and the caller exits 1), PYTHONPATH on their source trees.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site
lscpu > "$OUT/lscpu.txt"
(cd packages/cpumoe-formats && python3 hatch_build.py) > "$OUT/build.log" 2>&1 \
  && (cd packages/cpumoe-executor && PYTHONPATH=../cpumoe-formats/src:/tmp/site python3 hatch_build.py) >> "$OUT/build.log" 2>&1 \
  || { tail -30 "$OUT/build.log"; echo "build failed"; exit 1; }
export PYTHONPATH=$PWD/packages/cpumoe-formats/src:$PWD/packages/cpumoe-executor/src:/tmp/site

# Sourced by the jobs/gpu_*.sh scripts on the lent GPU machine: the output folder ($OUT there, ./out
# elsewhere) and the wheels its image lacks, carried in $WHEELS (default .whl-hydra: hydra, omegaconf,
# antlr; .whl from ../shared/device/make-wheels.sh adds ray).
out=${OUT:-out}
mkdir -p "$out"
wheels=${WHEELS:-.whl-hydra}
if [ -d "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$wheels"/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1

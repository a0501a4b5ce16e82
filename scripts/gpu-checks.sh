#!/usr/bin/env bash
# The GPU checks still owed, in one device call of under 10 minutes (written 2026-11-27 for the
# next session lent a GPU; docs/benchmarks.md says which are open):
# 1. fewshot-ft's demo on the card (never run on a GPU: batch norm there is candle's composition);
# 2. the fused backward with accumulation and the offloaded 8-bit moments at FLAN-T5-XL's shape
#    (`xl-fit-8GiB` of scripts/gpu-fit-xl.sh), which measured 12.55 GiB against 7.81 planned from
#    its second step before `GradAccumulator::take_whole`; expected now: the plan within a few %
#    in every step (since 2026-11-28 `--fit 8GiB` keeps some segments, `budget:B`, where it
#    chose `full-host`);
# 3. the `budget:B` plan with the gradients formed so far (2026-11-27) and T5's refitted
#    temporaries (2026-11-28): `xl-fit-24GiB` chooses a B the plan prints at start, where the
#    old plan chose `budget:12106MiB` and measured 24% under it; expected: measured at or under
#    the plan, and under 24 GiB;
# 4. the CUDA op tests, with what time is left (since 2026-11-29 `gated_matches_the_cpu`: the
#    gated feed-forward's kernel, never run on a GPU; rows 2 and 3 run T5 with it, their plans
#    without the activation's tensor, 1.17 GiB less at `none`; and `norm_affine_matches_the_cpu`:
#    the norms with their weight, bias and activation as one op, its forward and backward
#    kernels never run on a GPU; the plans of rows 2 and 3 count one tensor a
#    norm, FLAN-T5-XL 1.05 GiB less at `none`);
# 5. run first (seconds; added 2026-11-28): NCCL on the card as a world of one (`nccl_tests`:
#    ft-dist's all-reduce, reduce and broadcast; `nccl_trainer_tests gpu_tests`: a gradient
#    bucket concatenated, summed in place and split back), libnccl.so.2 from PyTorch's wheel.
#
#   bash scripts/gpu-pack.sh                            # here: builds .gpu/main (and .gpu/kernels, .gpu/nccl)
#   # device call, carrying .gpu/main and .gpu/nccl:  OUT=$OUT bash scripts/gpu-checks.sh
#
# FS_T, FIT_T, TEST_T: each part's time limit in seconds; ROWS: gpu-fit-xl.sh's rows.
set -uo pipefail
cd "$(dirname "$0")/.."
O=${OUT:-gpu-checks-out}
mkdir -p "$O"
python3 -c "import tarfile; tarfile.open('.gpu/main/bins.tar.xz').extractall('/tmp')"
[ -f .gpu/nccl/bins.tar.xz ] && python3 -c "import tarfile; tarfile.open('.gpu/nccl/bins.tar.xz').extractall('/tmp')"
for d in /usr/local/cuda/lib64 $(python3 -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "cu13", "lib"), os.path.join(nvidia.__path__[0], "nccl", "lib"))' 2>/dev/null); do
  [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
date -u +%FT%TZ
echo "== NCCL on one GPU"
if [ -x /tmp/b/nccl_tests ]; then
  FT_REQUIRE_GPU=1 timeout 60 /tmp/b/nccl_tests --test-threads=1 > "$O/nccl.log" 2>&1
  FT_REQUIRE_GPU=1 timeout 60 /tmp/b/nccl_trainer_tests gpu_tests --test-threads=1 >> "$O/nccl.log" 2>&1
  grep -E "^test |test result|panicked|NCCL" "$O/nccl.log" | head -20
fi
echo "== fewshot-ft --demo --device cuda"
(time timeout "${FS_T:-90}" /tmp/b/fewshot-ft --demo --device cuda --output-dir /tmp/fs-demo) > "$O/fewshot-demo.log" 2>&1
tail -25 "$O/fewshot-demo.log"
cp /tmp/fs-demo/memory.svg "$O/fewshot-demo-memory.svg" 2> /dev/null
echo "== gpu-fit-xl.sh rows: ${ROWS:-xl-fit-8GiB xl-fit-24GiB}"
ROWS=${ROWS:-xl-fit-8GiB xl-fit-24GiB} RUN_TIMEOUT=${FIT_T:-200} T5FT=/tmp/b/t5-ft bash scripts/gpu-fit-xl.sh "$O/fit"
date -u +%FT%TZ
echo "== CUDA op tests"
ONLY=tests BIN_DIR=/tmp/b STEP_TIMEOUT=${TEST_T:-60} bash scripts/gpu-bench.sh /tmp/bench > /dev/null 2>&1
cp /tmp/bench/cuda_tests.log "$O/" 2> /dev/null
grep -E "test result|FAILED|panicked|failed" "$O/cuda_tests.log" | head -20
date -u +%FT%TZ

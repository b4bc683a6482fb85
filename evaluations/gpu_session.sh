#!/usr/bin/env bash
# One GPU machine's whole session in the background: the set-up, the GPU tier, then the TE
# bench suite, writing results and logs under /tmp/gwres. A device call's command may run
# 10 minutes and the tier plus the suite take longer, so the first call starts this with
# setsid (it outlives the call) and each later call, made at once, waits and copies
# /tmp/gwres to $OUT (docs/development.md, "A whole GPU session"). It runs from a copy of
# the checkout, so a later call's fresh copy of the tree does not change the code under it.
#   setsid nohup bash evaluations/gpu_session.sh COMMIT [all|tier|core|bench] >/dev/null 2>&1 </dev/null &
# all: the tier's core tests (TE resume, conversion, TE and cuBLASLt GEMMs), the rest of the
# tier, then `bench_gpu --suite te`; tier: the tier only; core: its core tests only; bench:
# the suite only; core_bench: the core tests, then the suite (for a session short of device
# time); rest_bench: the tier's tests an earlier call did not pass (RESUME=FILE.json, that
# call's file), then the suite. CASES="a b" runs only those cases of the suite. ADVISE=1
# first runs `launcher=advise launcher.verify=3` on the 8B shape (16 layers, 8 on an 80 GB card; bf16 or torchao
# FP8 offered) on this card, its advise.json and each run's summary.json kept in $R/advise. Needs .whl/ and .te/ carried
# (docs/development.md, "Transformer Engine").
R=/tmp/gwres; W=/tmp/gw; MODE=${2:-all}
mkdir -p $R
exec > $R/session.log 2>&1
set -x
date
rm -rf $W; cp -r "$PWD" $W; cd $W
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export GRIDWRIGHT_COMMIT=${1:?commit}
bash .te/install_te.sh .te /tmp/tesite && export PYTHONPATH=/tmp/tesite:$PYTHONPATH
python -m pip install -q --no-deps .whl/*.whl && python -m pip install -q --no-deps --no-build-isolation -e .
if [ -n "$ADVISE" ]; then
    read -r gpu gib < <(python -c "import torch; p = torch.cuda.get_device_properties(0); \
print(p.name.replace(' ', '_'), round(p.total_memory / 2**30, 1))")
    layers=16; [ "${gib%.*}" -lt 100 ] && layers=8  # 16 layers' weights and Adam outgrow an 80 GB card
    timeout 480 python launch.py model=llama3_8b model.num_layers=$layers cluster=h100_x1 cluster.gpu.name=$gpu \
        cluster.gpu.memory_gib=$gib precision=bf16 engine.layer_spec=torch_native train.seq_length=4096 \
        train.global_batch_size=8 train.lr=3e-4 train.min_lr=3e-5 train.warmup_steps=3 tracking=off \
        launcher=advise 'launcher.precisions=[bf16,fp8_tensorwise]' launcher.verify=3 launcher.verify_steps=6 \
        job_root=/tmp/adv > $R/advise.log 2>&1
    echo "advise done: rc=$?"; date
    (cd /tmp/adv && find . -name advise.json -o -name summary.json | tar czf $R/advise.tgz -T -)
fi
if [ "$MODE" = rest_bench ]; then
    timeout 420 python -m gridwright.evaluations.gpu_tier --out $R --budget 390 --test-timeout 200 \
        --resume "${RESUME:?RESUME=FILE.json}" > $R/gpu_tier_rest.log 2>&1
    echo "tier done: rc=$?"; date
elif [ "$MODE" != bench ]; then
    budget=420; [ "$MODE" != all ] && [ "$MODE" != tier ] && budget=240
    timeout $((budget + 30)) python -m gridwright.evaluations.gpu_tier --out $R --budget $budget --test-timeout 200 \
        -- -k "resumes_exactly or converts or computes_in_fp8 or cublaslt" > $R/gpu_tier_core.log 2>&1
    echo "core done: rc=$?"; date
    [ "$MODE" = core ] && exit 0
    cp $R/gpu_tier_1x*.json $R/core.json
fi
if [ "$MODE" = all ] || [ "$MODE" = tier ]; then
    timeout 700 python -m gridwright.evaluations.gpu_tier --out $R --budget 660 --test-timeout 200 \
        --resume $R/core.json > $R/gpu_tier_rest.log 2>&1
    echo "tier done: rc=$?"; date
    [ "$MODE" = tier ] && exit 0
fi
timeout 1500 python -m gridwright.evaluations.bench_gpu --suite te --out $R --jobs /tmp/jb --case-timeout 160 \
    ${CASES:+--only $CASES} > $R/bench.log 2>&1
echo "bench done: rc=$?"; date

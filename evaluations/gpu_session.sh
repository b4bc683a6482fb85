#!/usr/bin/env bash
# One GPU machine's whole session in the background: the set-up, the GPU tier, the
# advisor's check, then the TE bench suite, writing results and logs under /tmp/gwres. A
# device call's command may run 10 minutes and the whole takes longer, so the first call
# starts this with setsid (it outlives the call) and each later call, made at once, waits
# and copies /tmp/gwres to $OUT (docs/development.md, "A whole GPU session"). It runs from a
# copy of the checkout, so a later call's fresh copy of the tree does not change the code under it.
#   setsid nohup bash evaluations/gpu_session.sh COMMIT [MODE] >/dev/null 2>&1 </dev/null &
# MODE, the steps in order:
#   all         the tier's core tests (TE resume, conversion, TE and cuBLASLt GEMMs), the rest
#               of the tier, then `bench_gpu --suite te` (the default)
#   tier        the tier only;  core: its core tests only;  bench: the suite only
#   core_bench  the core tests, then the suite (a session short of device time)
#   rest_bench  the tier's tests an earlier call on this card did not pass (RESUME=its .json),
#               then the suite
#   select      the tier's tests that pytest's -k "$SELECT" picks (RESUME=FILE.json keeps an
#               earlier call's passes, on the same card only)
# CASES="a b" runs only those cases of the suite. ADVISE=1 adds, after the tier,
# `launcher=advise launcher.verify=3` on the 8B shape (16 layers, 8 on an 80 GB card; bf16 or
# torchao FP8 offered) on the card present: advise.log, and advise.tgz with its advise.json
# and each run's summary.json. Needs .whl/ and .te/ carried (docs/development.md, "Transformer Engine").
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

tier() {  # tier LOG BUDGET [gpu_tier arguments]
    local log=$1 budget=$2; shift 2
    timeout $((budget + 30)) python -m gridwright.evaluations.gpu_tier --out $R --budget $budget --test-timeout 200 \
        "$@" > $R/$log 2>&1
    echo "tier part done: rc=$?"; date
}
core() {
    tier gpu_tier_core.log $1 -- -k "resumes_exactly or converts or computes_in_fp8 or cublaslt"
    cp $R/gpu_tier_1x*.json $R/core.json
}
advise() {
    [ -n "$ADVISE" ] || return 0
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
}
bench() {
    timeout 1500 python -m gridwright.evaluations.bench_gpu --suite te --out $R --jobs /tmp/jb --case-timeout 160 \
        ${CASES:+--only $CASES} > $R/bench.log 2>&1
    echo "bench done: rc=$?"; date
}

case "$MODE" in
    all) core 420; tier gpu_tier_rest.log 660 --resume $R/core.json; advise; bench ;;
    tier) core 420; tier gpu_tier_rest.log 660 --resume $R/core.json; advise ;;
    core) core 240; advise ;;
    bench) advise; bench ;;
    core_bench) core 240; advise; bench ;;
    rest_bench) tier gpu_tier_rest.log 390 --resume "${RESUME:?RESUME=FILE.json}"; advise; bench ;;
    select) tier gpu_tier_select.log 390 ${RESUME:+--resume "$RESUME"} -- -k "${SELECT:?SELECT=expression}"; advise ;;
    *) echo "unknown mode $MODE"; exit 2 ;;
esac
echo "session done"; date

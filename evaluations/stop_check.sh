# Stops on a GPU machine: SIGTERM of the local launcher (saves, stops) and SIGKILL of it
# (agent and workers follow). Run from the repository root on the GPU machine, after its
# set-up (torch with CUDA, then this package; see the README's quick start); writes logs under $OUT.
#   OUT=/tmp/out bash evaluations/stop_check.sh
set -e
[ -n "${OUT:-}" ] || { echo "set OUT"; exit 2; }
A="cluster=h100_x2 precision=bf16 tracking=off train.steps=3000 checkpoint.save_interval=1000"
python3 launch.py $A checkpoint.save=$OUT/ck job_dir=$OUT/term > $OUT/term.log 2>&1 &
L=$!; sleep 45; kill -TERM $L; T0=$(date +%s); wait $L || echo "launcher rc=$?"; echo "stop took $(( $(date +%s) - T0 )) s"
grep -E "stopped|checkpoint  saved|^stopped" $OUT/term.log | tail -3; cat $OUT/ck/latest
echo "workers left after SIGTERM: $(ps aux | grep -c '[g]ridwright.worker')"
python3 launch.py $A checkpoint.save=$OUT/ck2 job_dir=$OUT/kill > $OUT/kill.log 2>&1 &
L=$!; sleep 45; kill -KILL $L; T0=$(date +%s)
for i in $(seq 1 30); do n=$(ps aux | grep -c '[g]ridwright\.\(worker\|launchers\)' || true); [ "$n" = 0 ] && break; sleep 1; done
echo "after kill -9 of the launcher: $n run processes left after $(( $(date +%s) - T0 )) s"
tail -4 $OUT/kill.log
# A SIGKILL of the launcher 3 s into a stop that saves: the stop must still finish its save.
python3 launch.py $A checkpoint.save=$OUT/ck3 job_dir=$OUT/double > $OUT/double.log 2>&1 &
L=$!; sleep 45; kill -TERM $L; sleep 3; kill -KILL $L; T0=$(date +%s)
for i in $(seq 1 40); do n=$(ps aux | grep -c '[g]ridwright\.\(worker\|launchers\)' || true); [ "$n" = 0 ] && break; sleep 1; done
echo "SIGTERM then SIGKILL 3 s later: $n run processes left after $(( $(date +%s) - T0 )) s; latest: $(cat $OUT/ck3/latest 2>/dev/null || echo none)"
grep -E "stopped|checkpoint  saved" $OUT/double.log | tail -2

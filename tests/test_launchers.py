"""Plan-only, multi-node torchrun and Slurm launchers: what they print and write."""
import json
import subprocess
import sys

import pytest

from conftest import only_job_dir

from gridwright.planning.model_math import model_flops_per_token, param_counts


def test_plan_prints_mixtral_ep8_placement_and_runs_nothing(run_launch, tmp_path, compose):
    result = run_launch("+experiment=mixtral_ep8", "launcher=plan")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "TP=1 PP=1 CP=1 DP=8 EP=8 ETP=1 EDP=1" in out and "nothing started" in out
    table = out.split("placement\n", 1)[1].splitlines()
    assert len([line for line in table if line.strip() and line.split()[0].isdigit()]) == 8
    job = only_job_dir(tmp_path)
    assert sorted(p.name for p in job.iterdir()) == [
        "config.yaml", "job.json", "placement.csv", "placement.json", "plan.json"]
    doc = json.loads((job / "placement.json").read_text())
    assert [r["ep"] for r in doc["ranks"]] == list(range(8))
    # plan.json: the numbers the plan predicts, under both FLOPs definitions.
    plan = json.loads((job / "plan.json").read_text())
    assert plan["tokens_per_step"] == 64 * 4096  # the preset's global batch and sequence
    model = compose("+experiment=mixtral_ep8").model
    assert plan["flops_per_token"] == {d: model_flops_per_token(model, 4096, d) for d in ("megatron", "palm")}
    assert plan["flops_definition"] == "megatron" and plan["peak_kind"] == "bf16"
    assert plan["params"]["total"] == param_counts(model).total
    assert 0 < plan["memory_estimate_gib"] < 80 and plan["layout"]["slug"] == "ep8-dp8"
    assert plan["groups"]["ep"] == [list(range(8))]
    assert f"FLOPs/token {plan['flops_per_token']['megatron'] / 1e9:,.2f} G (megatron" in out
    assert not (tmp_path / "mlflow.db").exists()


def test_multinode_torchrun_emits_one_command_per_node(run_launch, tmp_path):
    result = run_launch("+experiment=llama3_70b", "launcher=torchrun", "launcher.master_addr=10.0.0.1")
    assert result.returncode == 0, result.stderr
    job = only_job_dir(tmp_path)
    lines = [l for l in (job / "torchrun_commands.sh").read_text().splitlines() if "gridwright.launchers.agent" in l]
    assert len(lines) == 8
    for node, line in enumerate(lines):
        assert f"--node_rank={node}" in line and "--nnodes=8" in line and "--nproc_per_node=8" in line
        assert "--master_addr=10.0.0.1" in line and "NCCL_NVLS_ENABLE" not in line  # no policy of gridwright's
        assert f"--job-dir {job}" in line
    assert subprocess.run(["bash", "-n", str(job / "torchrun_commands.sh")]).returncode == 0


def test_slurm_keys(run_launch, tmp_path):
    result = run_launch("launcher=slurm", "cluster.nodes=2", "cluster.gpus_per_node=1", "launcher.gpu_request=gres",
                        "launcher.cpus_per_task=4", "launcher.mem=20G", "launcher.qos=high", "launcher.constraint=a100",
                        "launcher.exclusive=false", "launcher.python=/opt/venv/bin/python",
                        "launcher.extra_directives=['--reservation=r1','--mail-type=END']",
                        "launcher.setup='module load cuda\nsource /opt/venv/bin/activate'")
    assert result.returncode == 0, result.stderr
    script = (only_job_dir(tmp_path) / "job.sbatch").read_text()
    directives = [l for l in script.splitlines() if l.startswith("#SBATCH")]
    for text in ("--gres=gpu:1", "--cpus-per-task=4", "--mem=20G", "--qos=high", "--constraint=a100",
                 "--reservation=r1", "--mail-type=END"):
        assert f"#SBATCH {text}" in directives, text
    assert "#SBATCH --exclusive" not in directives and not any("gpus-per-node" in d for d in directives)
    assert "module load cuda\nsource /opt/venv/bin/activate\n" in script
    assert script.index("source /opt/venv/bin/activate") < script.index("srun --kill-on-bad-exit")
    assert "/opt/venv/bin/python -m gridwright.launchers.agent" in script
    assert "export OMP_NUM_THREADS=1" in script  # a CPU cluster
    assert subprocess.run(["bash", "-n", str(only_job_dir(tmp_path) / "job.sbatch")]).returncode == 0


def test_slurm_script(run_launch, tmp_path):
    result = run_launch("+experiment=llama3_8b", "launcher.partition=gpu", "launcher.account=ml")
    assert result.returncode == 0, result.stderr
    job = only_job_dir(tmp_path)
    script = (job / "job.sbatch").read_text()
    for text in ("#SBATCH --nodes=2", "#SBATCH --gpus-per-node=8", "#SBATCH --partition=gpu",
                 "#SBATCH --account=ml", "--node_rank=$SLURM_NODEID", "placement.json",
                 f"-m gridwright.launchers.agent --job-dir {job}", "scontrol show hostnames",
                 f"{sys.executable} -m", "hostname --ip-address", "#SBATCH --requeue",
                 f"--output={job}/slurm-%j-node%n.out"):
        assert text in script, text
    assert subprocess.run(["bash", "-n", str(job / "job.sbatch")]).returncode == 0
    assert f"sbatch {job}/job.sbatch" in result.stdout
    assert "NCCL_NVLS_ENABLE" not in script  # a cluster's NCCL policy is its own (cluster.env)


def test_a_clusters_env_reaches_every_launchers_workers(compose):
    """cluster.env is exported by every launcher; the development presets carry theirs."""
    from gridwright.launchers.environment import worker_env

    assert "NCCL_NVLS_ENABLE" not in worker_env(compose("cluster=dgx_h100"))
    env = worker_env(compose("cluster=dgx_h100", "+cluster.env.NCCL_IB_HCA=mlx5", "+cluster.env.NCCL_DEBUG=WARN"))
    assert env["NCCL_IB_HCA"] == "mlx5" and env["NCCL_DEBUG"] == "WARN"
    for preset in ("h100_x1", "h100_x2", "h100_x4"):
        env = worker_env(compose(f"cluster={preset}"))
        assert (env["NCCL_NVLS_ENABLE"], env["TORCH_SYMM_MEM_DISABLE_MULTICAST"], env["NVSHMEM_DISABLE_NVLS"]) == ("0", "1", "1")


def test_large_plan_table_is_compact(run_launch, tmp_path):
    result = run_launch("+experiment=llama3_70b", "launcher=plan", "cluster.nodes=64")
    assert result.returncode == 0, result.stderr
    assert "ranks not shown; see placement.csv" in result.stdout
    job = only_job_dir(tmp_path)
    assert len((job / "placement.csv").read_text().splitlines()) == 512 + 1


@pytest.mark.slow
def test_layout_sweep_reports_invalid_points_and_goes_on(tmp_path):
    """`-m` sweeps layouts: an invalid point is reported, the valid ones are planned."""
    from conftest import launch

    result = launch(["-m", "parallel.tp=3,2", "launcher=plan", f"job_root={tmp_path / 'jobs'}"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "sweep point 0 ended with exit code 2" in result.stderr
    assert "parallel.tp=3" in result.stderr
    assert "TP=2 PP=1 CP=1 DP=1" in result.stdout
    # A sweep keeps its points in one directory: jobs/sweeps/<experiment>/<time>-<id>/<n>-<layout>
    planned = [p for p in (tmp_path / "jobs").glob("sweeps/*/*/*") if (p / "placement.json").exists()]
    assert len(planned) == 1


def test_plan_with_a_comm_profile_predicts_each_groups_communication(run_launch, tmp_path):
    """The alpha-beta profile measured on 2 x H100 turns the plan's call list into seconds."""
    from pathlib import Path

    profile = Path(__file__).parent / "data" / "comm_profile_2xh100.json"
    result = run_launch("+bench=eval_tp2_sp", "launcher=plan", f"cluster.comm_profile={profile}")
    assert result.returncode == 0, result.stderr
    plan = json.loads((only_job_dir(tmp_path) / "plan.json").read_text())
    tp = plan["predicted_communication"]["tp"]
    assert tp["group_size"] == 2 and tp["bytes"] > 0 and tp["seconds"] > 0
    from gridwright.planning.comm_model import CommProfile

    measured = CommProfile.load(profile)
    for call in tp["calls"]:  # each call's seconds: count x the fitted time of one call
        one = measured.seconds(call["collective"], call["group_size"], call["size_bytes"])
        assert call["seconds"] == pytest.approx(call["count"] * one)
    assert tp["seconds"] == pytest.approx(sum(call["seconds"] for call in tp["calls"]))
    assert f"comm/step   tp {tp['bytes'] / 1e6:,.0f} MB {tp['seconds'] * 1e3:,.1f} ms" in result.stdout

"""Collective latency and bandwidth, nccl-tests style, fitted to the alpha-beta model.

    torchrun --nproc_per_node N -m gridwright.evaluations.bench_collectives --out profile.json \\
        [--job-dir DIR] [--min-bytes 1024] [--max-bytes 1073741824] [--factor 2] \\
        [--iters 20] [--warmup 5] [--plot profile.png]

NCCL on GPUs (NVLink multicast/NVLS off: NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 are set when absent and
required when present), gloo on CPUs.

Which groups: with --job-dir, the groups of that job's placement.json, every kind whose
groups have more than one rank (kinds with identical groups, e.g. dp and dp_cp without
CP, are timed once); without it, groups of 2, 4, 8, ... ranks (and the whole world) over
consecutive ranks. Every group of a kind or size runs at once, as in training.

What is timed, per collective and message size (nccl-tests conventions, see
gridwright.planning.comm_model): all_reduce, all_gather, reduce_scatter, all_to_all, and send_recv
(each rank sends to the next member of its group and receives from the previous one; a
pair exchange in groups of 2). float32 buffers; warm-up calls, then --iters timed calls
between CUDA events (GPU) or perf_counter readings (CPU); the time of a size is the mean
per call, maximised over ranks, as nccl-tests reports it. Rank 0 prints a table per
group size and collective and writes the profile with its fits (gridwright.planning.comm_model.
CommProfile), plus a plot with --plot.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

from gridwright.planning.comm_model import (
    COLLECTIVES,
    CommProfile,
    alg_bandwidth,
    bus_bandwidth,
    new_meta,
    plot_profile,
)

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
DTYPE_BYTES = 4  # float32, as nccl-tests' default


def parse_bytes(text: str) -> int:
    """1024, 2**30, 64K, 16M, 1G (binary units)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    try:
        if "**" in t:
            base, exp = t.split("**")
            return int(base) ** int(exp)
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 1024, 2**30, 64K, 1G)") from None


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="profile JSON to write (atomically)")
    ap.add_argument("--job-dir", help="time the groups of this job's placement.json")
    ap.add_argument("--min-bytes", type=parse_bytes, default=1024)
    ap.add_argument("--max-bytes", type=parse_bytes, default=None,
                    help="largest message (default 1 GiB on GPUs, 64 MiB on CPUs)")
    ap.add_argument("--factor", type=int, default=2, help="size step: 2 (doubling) or 4")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per size")
    ap.add_argument("--warmup", type=int, default=5, help="untimed calls per size")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--plot", help="also write a PNG of the points and fits")
    args = ap.parse_args(argv)
    if args.factor < 2:
        ap.error("--factor must be at least 2")
    if args.min_bytes < 1 or args.iters < 1 or args.warmup < 0:
        ap.error("--min-bytes and --iters must be positive, --warmup non-negative")
    return args


def message_sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    sizes, s = [], min_bytes
    while s <= max_bytes:
        sizes.append(s)
        s *= factor
    return sizes


def actual_size(collective: str, size_bytes: int, n: int) -> int:
    """The message size really timed: whole float32 elements, at least one per rank, and a
    multiple of n elements for the collectives that split the buffer over the group."""
    if collective in ("all_reduce", "send_recv"):
        return max(1, size_bytes // DTYPE_BYTES) * DTYPE_BYTES
    return max(1, size_bytes // (DTYPE_BYTES * n)) * n * DTYPE_BYTES


def consecutive_partitions(world: int) -> list[tuple[list[str], list[list[int]]]]:
    """Groups of 2, 4, 8, ... consecutive ranks (and the whole world); no kinds."""
    sizes, n = [], 2
    while n <= world:
        sizes.append(n)
        n *= 2
    if world > 1 and world not in sizes:
        sizes.append(world)
    return [([], [list(range(i, i + n)) for i in range(0, world - n + 1, n)]) for n in sizes]


def partitions_from_placement(doc: dict) -> list[tuple[list[str], list[list[int]]]]:
    """Each distinct set of groups (size > 1) of a placement.json, with the kinds sharing it,
    in the placement's kind order."""
    out: dict = {}
    for kind, groups in doc["groups"].items():
        if not groups or len(groups[0]) < 2:
            continue
        key = tuple(tuple(int(r) for r in g) for g in groups)
        out.setdefault(key, []).append(kind)
    return [(kinds, [list(g) for g in key]) for key, kinds in out.items()]


def _require_multicast_off() -> None:
    for name, value in MULTICAST_OFF.items():
        have = os.environ.setdefault(name, value)
        if have != value:
            raise SystemExit(f"{name}={have} in the environment; this benchmark needs {name}={value} "
                             "(NVLink multicast stays off on these machines). Unset it or set it to that.")


class _Runner:
    """Process-group set-up and one timed collective."""

    def __init__(self, device: str):
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
        if self.cuda:
            _require_multicast_off()
            local = int(os.environ.get("LOCAL_RANK", 0))
            torch.cuda.set_device(local)
            self.device = torch.device("cuda", local)
            dist.init_process_group("nccl", device_id=self.device)
        else:
            self.device = torch.device("cpu")
            dist.init_process_group("gloo")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.backend = dist.get_backend()

    def device_name(self) -> str:
        if self.cuda:
            return self.torch.cuda.get_device_name(self.device)
        return f"cpu ({platform.processor() or platform.machine()})"

    def groups(self, partition: list[list[int]]):
        """Create every group of the partition (same order on every rank); return this
        rank's (group, members), or (None, None) when it is in none of them."""
        mine = (None, None)
        for members in partition:
            g = self.dist.new_group(ranks=members)
            if self.rank in members:
                mine = (g, members)
        return mine

    def make_op(self, collective: str, size_bytes: int, group, members: list[int]):
        """A callable running one call of `actual_size(collective, size_bytes, n)` bytes."""
        torch, dist = self.torch, self.dist
        n = len(members)
        numel = actual_size(collective, size_bytes, n) // DTYPE_BYTES

        def zeros(k):
            return torch.zeros(k, dtype=torch.float32, device=self.device)

        if collective == "all_reduce":
            buf = zeros(numel)
            return lambda: dist.all_reduce(buf, group=group)
        if collective == "send_recv":
            send, recv = zeros(numel), zeros(numel)
            i = members.index(self.rank)
            ops = [dist.P2POp(dist.isend, send, members[(i + 1) % n], group),
                   dist.P2POp(dist.irecv, recv, members[(i - 1) % n], group)]

            def send_recv():
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
            return send_recv
        whole, part = zeros(numel), zeros(numel // n)
        # torch 2.13 renamed the *_into_tensor / *_tensor forms; older torch has only those.
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        if collective == "all_gather":
            return lambda: all_gather(whole, part, group=group)
        if collective == "reduce_scatter":
            return lambda: reduce_scatter(part, whole, group=group)
        received = zeros(numel)
        return lambda: dist.all_to_all_single(received, whole, group=group)

    def time_call(self, op, iters: int, warmup: int) -> float:
        """Mean seconds per call on this rank (0 when op is None: in no group)."""
        torch = self.torch
        if op is not None:
            for _ in range(warmup):
                op()
        if self.cuda:
            torch.cuda.synchronize()
        self.dist.barrier()
        mean = 0.0
        if op is not None:
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(iters):
                    op()
                end.record()
                end.synchronize()
                mean = start.elapsed_time(end) / 1e3 / iters
            else:
                t0 = time.perf_counter()
                for _ in range(iters):
                    op()
                mean = (time.perf_counter() - t0) / iters
        return mean

    def max_over_ranks(self, value: float) -> float:
        t = self.torch.tensor([value], dtype=self.torch.float64, device=self.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return float(t.item())


def format_table(collective: str, n: int, label: str, points: list[tuple[int, float]]) -> str:
    """nccl-tests-like rows: size, count, time, algorithm and bus bandwidth."""
    lines = [f"# {collective} on groups of {n} {label}",
             f"# {'size(B)':>12} {'count':>11} {'time(us)':>10} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12}"]
    for size, sec in points:
        algbw, busbw = alg_bandwidth(size, sec) / 1e9, bus_bandwidth(collective, n, size, sec) / 1e9
        lines.append(f"  {size:>12} {size // DTYPE_BYTES:>11} {sec * 1e6:>10.2f} {algbw:>12.3f} {busbw:>12.3f}")
    return "\n".join(lines)


def run(args) -> CommProfile | None:
    if "RANK" not in os.environ:
        raise SystemExit("start this under torchrun: torchrun --nproc_per_node N -m "
                         "gridwright.evaluations.bench_collectives --out profile.json")
    r = _Runner(args.device)
    max_bytes = args.max_bytes or (2**30 if r.cuda else 2**26)
    sizes = message_sizes(args.min_bytes, max_bytes, args.factor)
    if not sizes:
        raise SystemExit(f"no message sizes between --min-bytes {args.min_bytes} and --max-bytes {max_bytes}")
    if args.job_dir:
        doc = json.loads((Path(args.job_dir) / "placement.json").read_text())
        if int(doc["layout"]["world_size"]) != r.world:
            raise SystemExit(f"{args.job_dir}/placement.json plans {doc['layout']['world_size']} ranks "
                             f"but torchrun started {r.world}; start --nproc_per_node x nodes = that many.")
        partitions = partitions_from_placement(doc)
        source = f"job_dir {Path(args.job_dir).resolve()}"
    else:
        partitions = consecutive_partitions(r.world)
        source = "consecutive ranks"
    if not partitions:
        raise SystemExit("no group of more than one rank to time (a single process?)")
    by_size: dict = {}  # collective -> {n: points}, consecutive mode
    kinds: dict = {}  # kind -> (n, num_groups, points), job-dir mode
    for kind_names, partition in partitions:
        n = len(partition[0])
        group, members = r.groups(partition)
        label = f"({len(partition)} groups)"
        if kind_names:
            label = f"({', '.join(kind_names)}; {len(partition)} groups)"
        points: dict = {}
        for coll in COLLECTIVES:
            pts = []
            for size in sizes:
                # A rank in no group of this size (consecutive mode) still joins the barrier and max.
                op = r.make_op(coll, size, group, members) if group is not None else None
                sec = r.max_over_ranks(r.time_call(op, args.iters, args.warmup))
                pts.append((actual_size(coll, size, n), sec))
            points[coll] = {n: pts}
            if r.rank == 0:
                print(format_table(coll, n, label, pts), flush=True)
        if kind_names:
            for k in kind_names:
                kinds[k] = (n, len(partition), points)
        else:
            for coll, by_n in points.items():
                by_size.setdefault(coll, {}).update(by_n)
    profile = None
    if r.rank == 0:
        import torch

        meta = new_meta(source=source, iters=args.iters, warmup=args.warmup, dtype="float32",
                        torch=torch.__version__,
                        nccl=".".join(map(str, torch.cuda.nccl.version())) if r.cuda else None,
                        hosts=r.world // int(os.environ.get("LOCAL_WORLD_SIZE", r.world)))
        profile = CommProfile.from_points(r.device_name(), r.backend, r.world, by_size, kinds=kinds, meta=meta)
        profile.save(args.out)
        print(f"\nwrote {args.out}")
        for coll, by_n in profile.fits.items():
            for n, fit in sorted(by_n.items()):
                print(f"  {coll:>14} n={n:<4} alpha {fit.alpha_s * 1e6:9.2f} us   busbw "
                      f"{fit.bus_bandwidth_bytes_per_s / 1e9:9.2f} GB/s   rms rel err {fit.rms_rel_error:.3f}")
        if args.plot:
            print(f"wrote {plot_profile(profile, args.plot)}")
    r.dist.barrier()
    r.dist.destroy_process_group()
    return profile


def main(argv=None) -> None:
    run(parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])

"""The integer-dot tiles' compute rate at one row, on Qwen3-4B's projection shapes, against another
source tree's kernels in alternating rounds (issue 59: is the tile, not the memory, the limit?):

    python -m bench.quant_tile --baseline /work/main --rounds 7
    python -m bench.quant_tile --baseline /work/main --types Q6_K --threads 1

Each round runs one child process per tree (`--tree`: its `engine` is imported, so its kernels are
built and loaded) on the same seeded weights. A child times chains of one-row products through
the kernels' team of threads (kernels.quant_chain_seconds, as a decode step runs them), with 1 and
2 threads:
- `cache`: a slice of each shape of about 384 KiB (whole 16-row panels) run over and over, so the
  blocks come from L2 and the tile's arithmetic sets the pace;
- `memory`: distinct copies of the whole weight, 256 MB or more a chain, read from memory.
Rows give GB/s of blocks (the bytes as the kernels hold them) and ns a super-block record (16 rows
of 256 k) a thread, the median over the rounds, the baseline's beside this tree's. The machine is
shared: compare the two trees' medians, not single rounds.

`--cpu-time REF` instead compiles bench/tile_compare/quant_tile_compare.cpp with g++ against this
tree's VNNI tile and git REF's (its quant_tiles.h and quant_tiles_avx512.cpp in a namespace of their
own) and runs both in one process, alternating, one thread timed by its CPU time (what the other
loads of a shared machine disturb least; two threads by wall time):

    python -m bench.quant_tile --cpu-time main --types Q4_K,Q6_K --rounds 11
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

# Qwen3-4B's projections (K, N): gate and up, down, q, k/v.
SHAPES = {"gate_up": (2560, 9728), "down": (9728, 2560), "q": (2560, 4096), "kv": (2560, 1024)}
_CACHE_BYTES = 384 << 10
_MEMORY_BYTES = 256 << 20


def measure(types: list[str], threads: list[int], reps: int) -> list[dict]:
    """This process's tree: one timing per (type, shape, set, threads), the best of `reps` chains."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType

    from bench.random_blocks import random_blocks
    from engine.execution.kernels import load_cpu_kernels
    from engine.execution.weights.quantized_weight import QuantizedWeight

    kernels = load_cpu_kernels()
    if kernels is None:
        raise SystemExit("the C++ kernels did not build")
    isa = kernels.best_isa()
    rows: list[dict] = []
    for name in types:
        quant_type = GGMLQuantizationType[name]
        for shape, (k, n) in SHAPES.items():
            rng = np.random.default_rng(k * 7 + n)
            weight = QuantizedWeight.pack(random_blocks(quant_type, n, k, rng), quant_type, k)
            panel_bytes, record_bytes = weight.data[0].numel(), weight.data.shape[2]
            x = torch.from_numpy(rng.standard_normal((1, k)).astype(np.float32))
            # cache: the first panels, about _CACHE_BYTES, one weight run again and again
            num_panels = max(2, _CACHE_BYTES // panel_bytes)
            small = weight.data[:num_panels].contiguous()
            small_args = (small, int(quant_type), 16 * num_panels, k)
            chains = {"cache": ([small_args] * max(1, (64 << 20) // small.numel()), small.numel()),
                      "memory": _copies(weight, quant_type, k)}
            for set_name, (chain, chain_bytes) in chains.items():
                for num_threads in threads:
                    torch.set_num_threads(num_threads)
                    kernels.quant_chain_seconds(x, chain, 1, isa)  # warm: first touch, thread start
                    seconds = min(kernels.quant_chain_seconds(x, chain, 1, isa) for _ in range(reps))
                    total = chain_bytes * (len(chain) if set_name == "cache" else 1)
                    num_records = total // record_bytes
                    rows.append({"type": name, "shape": shape, "set": set_name, "threads": num_threads,
                                 "gbps": total / seconds / 1e9, "ns_per_record": seconds * num_threads / num_records * 1e9})
    return rows


def _copies(weight, quant_type, k: int) -> tuple[list, int]:
    """Distinct copies of weight until they hold _MEMORY_BYTES: (the chain's arguments, their bytes)."""
    per = weight.data.numel()
    copies = [weight.data] + [weight.data.clone() for _ in range(max(1, -(-_MEMORY_BYTES // per)) - 1)]
    return [(c, int(quant_type), weight.out_features, k) for c in copies], per * len(copies)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, help="another checkout's root (e.g. /work/main) to compare against")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (each tree once a round)")
    parser.add_argument("--types", default="Q4_K,Q6_K", help="comma-separated GGUF block types")
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--reps", type=int, default=3, help="chains a timing, the best kept")
    parser.add_argument("--cpu-time", metavar="REF", help="compare the VNNI tile against git REF's in one process")
    parser.add_argument("--rows", type=int, default=1, help="--cpu-time: activation rows (M)")
    parser.add_argument("--sets", default="small,large", help="--cpu-time: small (from L2), large (from memory)")
    parser.add_argument("--tree", type=Path, help=argparse.SUPPRESS)  # a child: measure with this tree's kernels
    args = parser.parse_args()
    types, threads = args.types.split(","), [int(t) for t in args.threads.split(",")]
    if args.tree is not None:
        print(json.dumps(measure(types, threads, args.reps)))
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.cpu_time:
        return compare_cpu_time(args.cpu_time, types, args.rows, args.rounds, args.sets)
    here = Path(__file__).resolve().parents[1]
    trees = {"this": here} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    results: dict[str, list[list[dict]]] = {name: [] for name in trees}
    for r in range(args.rounds):
        for name, tree in (trees.items() if r % 2 == 0 else reversed(trees.items())):
            command = [sys.executable, str(Path(__file__).resolve()), "--tree", str(tree), "--types", args.types,
                       "--threads", args.threads, "--reps", str(args.reps)]
            out = subprocess.run(command, cwd=tree, env=_env(tree), capture_output=True, text=True, check=True)
            results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            logger.info("round %d: %s done", r + 1, name)
    _report(results)


def compare_cpu_time(ref: str, types: list[str], rows: int, rounds: int, sets: str) -> None:
    """Builds and runs bench/tile_compare's program: this tree's tile against git ref's."""
    import shutil
    import tempfile

    from gguf import GGMLQuantizationType

    root = Path(__file__).resolve().parents[1]
    kernels = root / "engine" / "execution" / "kernels"
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "old"
        old.mkdir()
        for name in ("quant_tiles.h", "quant_tiles_avx512.cpp"):
            text = subprocess.run(["git", "show", f"{ref}:engine/execution/kernels/{name}"], cwd=root, check=True,
                                  capture_output=True, text=True).stdout
            (old / name).write_text(text.replace("namespace minivllm", "namespace mvold"))
        program = Path(tmp) / "quant_tile_compare"
        flags = ["-O3", "-march=native", "-std=c++17"]
        objects = []
        for source, include in ((old / "quant_tiles_avx512.cpp", old), (kernels / "quant_tiles_avx512.cpp", kernels)):
            objects.append(Path(tmp) / f"{len(objects)}.o")
            subprocess.run([shutil.which("g++") or "g++", *flags, f"-I{include}", "-c", str(source), "-o",
                            str(objects[-1])], check=True)
        subprocess.run(["g++", *flags, f"-I{tmp}", f"-I{kernels}", str(root / "bench" / "tile_compare" /
                        "quant_tile_compare.cpp"), *map(str, objects), "-o", str(program), "-lpthread"], check=True)
        for name in types:
            logger.info("%s, %d row(s), this tree against %s:", name, rows, ref)
            out = subprocess.run([str(program), str(int(GGMLQuantizationType[name])), str(rows), str(rounds), sets],
                                 check=True, capture_output=True, text=True).stdout
            for line in out.splitlines():
                logger.info("  %s", line.replace("old", "base").replace("new", "this"))


def _env(tree: Path) -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": str(tree)}


def _report(results: dict[str, list[list[dict]]]) -> None:
    keys = [(row["type"], row["shape"], row["set"], row["threads"]) for row in results["this"][0]]
    for i, (type_name, shape, set_name, threads) in enumerate(keys):
        cells = []
        medians = {}
        for name, rounds in results.items():
            gbps = statistics.median(rnd[i]["gbps"] for rnd in rounds)
            ns = statistics.median(rnd[i]["ns_per_record"] for rnd in rounds)
            medians[name] = gbps
            cells.append(f"{name} {gbps:6.1f} GB/s {ns:6.1f} ns/record")
        ratio = f"  x{medians['this'] / medians['baseline']:.3f}" if "baseline" in medians else ""
        logger.info("%-5s %-8s %-6s %d thread(s): %s%s", type_name, shape, set_name, threads, " | ".join(cells), ratio)


if __name__ == "__main__":
    main()

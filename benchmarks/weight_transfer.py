"""Weight transfer from the learner to a sampler over loopback: the wire against the folder.

Run: .venv/bin/python benchmarks/weight_transfer.py [--repeats 5] [--threads 2]
     .venv/bin/python benchmarks/weight_transfer.py --tiny --repeats 1   # a smoke run, seconds

One process plays both sides, as ``creditrl learner`` and ``creditrl sampler`` do on one
machine: SmolLM2-135M-Instruct (the embedded model) in float32, published as one new version
at a time and loaded into a second copy of the model, through

- ``folder``: ``FolderChannel`` (the learner writes ``vNNNNNNNN/weights.safetensors`` and
  ``latest`` under a temporary folder, the sampler reads and loads it): what samplers on the
  learner's disk use;
- ``wire``: ``WirePublisher`` packs the version (one copy) and hashes it into checksummed 8 MiB
  chunks, a ``WeightServer`` serves them on 127.0.0.1 (a thread of its own, no rate limit),
  and the sampler's ``WireChannel`` fetches them through a ``WeightClient`` (the manifest, then
  a window of chunk requests in flight), checks every hash, assembles the chunks in place and
  loads them: what samplers without that disk use.

For ``full`` (the plain fp32 model, ``kind=full``) and ``adapter`` (``model.lora_rank``=32 on
every linear, ``asynchronous.lora_sync=adapter``: the adapter tensors alone). The versions
differ (the weights change before each), and the two channels alternate version by version, so
the machine's drift falls on both. Each line: the median seconds per version, end to end
(publish, then the sampler's load), with its two halves (``publish``: the learner's side in
the step, synchronous here; ``load``: the sampler's), the bytes of one version, and
wire / folder, pair by pair (median).

``--tiny``: the tiny random model (a smoke run; the figures mean nothing).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_flags

from creditrl.asynchronous.launcher import free_port
from creditrl.asynchronous.weight_server import WeightClient, WeightServer
from creditrl.config.schema import AsyncConfig
from creditrl.weights import FolderChannel, WireChannel, WirePublisher
from creditrl.weights.hashing import HASHES, wire_hash

EXPLAINED = """\
What the wire pays for: the version's safetensors bytes packed in memory (one copy), every byte
hashed once on each side (per 8 MiB chunk, on up to 8 threads: at most the machine's cores;
SHA-256 on a CPU with SHA extensions, else BLAKE2b-256, `creditrl.weights.hashing`), the bytes
through loopback TCP (4 chunk requests in flight) and copied into place once on the sampler's
side, then read as views and copied into the model; the folder's file is written once and read
back from the page cache. Hashing dominates: without SHA extensions SHA-256 runs at about 380
MB/s a core here and BLAKE2b at about 640. In a run the learner's half runs in a background
thread (`publish(..., background=True)`: only the copy is in the step). Both sides run in one
process, on the same cores."""


def build_models(tiny: bool, lora: bool) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(learner's model, sampler's model), equal to begin with."""
    if tiny:
        from creditrl.models.tiny import tiny_model_dir

        path = str(tiny_model_dir())
    else:
        path = "embedded"
    from creditrl.models.loading import apply_lora, load_causal_lm

    learner = load_causal_lm(path, "float32")
    sampler = copy.deepcopy(learner)
    if lora:
        learner, sampler = apply_lora(learner, 32, 16), apply_lora(sampler, 32, 16)
        sampler.load_state_dict(learner.state_dict())
    return learner.eval(), sampler.eval()


@torch.no_grad()
def change(model: torch.nn.Module, lora: bool) -> None:
    """A new version: every trained tensor moves a little."""
    for name, param in model.named_parameters():
        if not lora or "lora_" in name:
            param.add_(1e-4)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(
    tiny: bool, lora: bool, repeats: int, hash_name: str | None
) -> dict[str, list[float] | int]:
    learner, sampler = build_models(tiny, lora)
    sync = "adapter" if lora else "merged"
    out: dict[str, list[float] | int] = {k: [] for k in (
        "folder_publish", "folder_load", "wire_publish", "wire_load")}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        folder_pub = FolderChannel(Path(tmp) / "w", publish=True, keep=2, lora_sync=sync)
        folder_sub = FolderChannel(Path(tmp) / "w")
        wire_pub = WirePublisher(lora_sync=sync, keep=2, hash_name=hash_name)
        server = WeightServer(AsyncConfig(), wire_pub, free_port())
        client = WeightClient(AsyncConfig(), "s0", server.address, timeout_s=120.0)
        wire_sub = WireChannel(client)
        try:
            version = 0
            for _ in range(repeats + 1):  # the first round warms both up, not counted
                for name, pub, sub in (("folder", folder_pub, folder_sub),
                                       ("wire", wire_pub, wire_sub)):  # fmt: skip
                    version += 1
                    change(learner, lora)
                    p = timed(lambda pub=pub, v=version: pub.publish(learner, v))
                    start = time.perf_counter()
                    loaded = sub.load(sampler)
                    t = time.perf_counter() - start
                    if not loaded or sub.version != version:
                        raise RuntimeError(f"{name} did not load version {version}")
                    if version > 2:
                        out[f"{name}_publish"].append(p)
                        out[f"{name}_load"].append(t)
            manifest = wire_pub.manifest(wire_pub.newest())
            out["bytes"] = manifest["size"]
            out["chunks"] = len(manifest["chunks"])
            out["hash"] = manifest["hash"]
        finally:
            client.close()
            server.close()
            folder_pub.writer.lock.release()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument(
        "--hash",
        choices=HASHES,
        default=None,
        help="the wire's hash (default: the one this CPU's flags choose)",
    )
    parser.add_argument("--out", type=Path, default=None, help="write the table here (Markdown)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    hash_name = args.hash or wire_hash()[0]
    lines = [
        f"cpu: {cpu_flags()}; torch threads {args.threads}; {args.repeats} versions per channel; "
        f"wire hash {hash_name}{'' if args.hash else f' ({wire_hash()[1]})'}",
        f"command: python benchmarks/weight_transfer.py --repeats {args.repeats} "
        f"--threads {args.threads}{' --tiny' if args.tiny else ''}"
        f"{f' --hash {args.hash}' if args.hash else ''}",
        "",
        "| publication | MB | channel | s/version (median) | publish | load | wire / folder |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, lora in (("fp32 full", False), ("LoRA adapter (r=32)", True)):
        r = run(args.tiny, lora, args.repeats, hash_name)
        total = {c: [p + q for p, q in zip(r[f"{c}_publish"], r[f"{c}_load"], strict=True)]
                 for c in ("folder", "wire")}  # fmt: skip
        ratio = statistics.median(w / f for w, f in zip(total["wire"], total["folder"],
                                                        strict=True))  # fmt: skip
        mb = r["bytes"] / 1e6
        for c in ("folder", "wire"):
            lines.append(
                f"| {label} | {mb:.1f} | {c} | {statistics.median(total[c]):.3f} | "
                f"{statistics.median(r[f'{c}_publish']):.3f} | "
                f"{statistics.median(r[f'{c}_load']):.3f} | "
                f"{f'{ratio:.2f}' if c == 'wire' else ''} |"
            )
        print(f"{label}: {r['chunks']} chunks, {r['hash']}", file=sys.stderr)
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.write_text(
            f"# Weight transfer over loopback: wire vs folder\n\n{text}\n\n{EXPLAINED}\n"
        )


if __name__ == "__main__":
    main()

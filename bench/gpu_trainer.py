"""A prepared GPU check of the update on verl's FSDP2 engine, through the trainer's own path.

Builds a Qwen2.5-0.5B-shaped model (tied embeddings, saved in bf16) locally and gives it
peaked logits with a few quick SFT steps on patterned synthetic text (random weights have
near-uniform logits, against which a bf16 log-prob gap means nothing). Then ``--steps`` PPO
updates through ``EngineTrainer`` in bf16 compute with fp32 master weights, micro-batches
and gradient checkpointing, on synthetic groups whose rollout log-probs are the engine's own
(so the importance weights start near 1); ``--kl`` adds the reference (verl's forward-only
engine on GPU) and its KL loss, ``--dynamic-bsz`` cuts micro-batches by tokens. After the
updates: one export of the weights in the server's dtype, read back with safetensors and
compared with the trainer's own; with ``--ipc`` two weight syncs by CUDA IPC
(``inference.transfer_engine: ipc``) into a second process that opens the handles as vLLM
does, checked against that export; and the trainer's half of the collocated hand-over (memory
after the update, after ``empty_cache``, after the offload ``--offload`` configures).

Prints JSON: trained tokens/s, memory at each stage, the log-prob gap between the engine and
a plain Hugging Face forward of the same weights, skipped (non-finite) steps, the export
check. Thresholds fail the run (exit 1, one line per failed figure on stderr): the log-prob
gap (``--max-gap``), an SFT that left the logits flat (``--max-sft-loss``), any skipped step,
an export (or a CUDA IPC sync) that differs from the trainer's weights or does not differ
from the initial model's, no KL after the actor moved (``--kl``), memory the hand-over does
not return (``--min-offload-gib``: the update's peak less what the trainer holds when the KV
cache wakes; ``--max-resident-gib``: what it holds then, GPU) and tokens/s
(``--min-tokens-per-s``). The figures so far go to ``$OUT/gpu_trainer.partial.json`` after
each phase.

Nothing is downloaded. ``--tiny`` is the CPU-sized variant CI runs (same code path).

Usage: python -m bench.gpu_trainer [--tiny] [--steps 5] [--groups 16] [--n 4]
       [--prompt-len 256] [--response-len 256] [--micro 4] [--kl] [--dynamic-bsz]
       [--offload] [--sft-steps N] [--max-gap 0.05] [--max-sft-loss X] [--lr 1e-5]
       [--min-tokens-per-s 0] [--min-offload-gib 0] [--max-resident-gib X] [--ipc]
       [--bucket-mb 256] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                  max_position_embeddings=32768, rope_theta=1000000.0)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024,
            rope_theta=10000.0)


# the ids patterned text is drawn from: few enough that a few SFT steps see each many times
# (over the 0.5B model's 151,936 ids each would be seen about once, and its logits stay flat)
PATTERN_IDS = 1024


def patterned(rng: random.Random, vocab: int, length: int) -> list[int]:
    """A sequence a model learns to predict in a few steps: a random start, then a fixed
    stride (mod the pattern's ids, above the special ids)."""
    span = min(vocab, PATTERN_IDS) - 3
    start, stride = rng.randrange(0, span), rng.choice((1, 2, 3, 5))
    return [1] + [3 + (start + stride * i) % span for i in range(length - 1)]


def build_model(out: Path, shape: dict, sft_steps: int, device: str, seed: int = 0
                ) -> dict[str, float]:
    """The model, SFT-ed for ``sft_steps`` on patterned text (fp32, AdamW), saved in bf16.
    -> the SFT's first and last loss."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0, rms_norm_eps=1e-6, torch_dtype="bfloat16", **shape)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(device)
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(sft_steps):
        ids = torch.tensor([patterned(rng, shape["vocab_size"], 64) for _ in range(8)],
                           device=device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    model.to(torch.bfloat16).save_pretrained(str(out), safe_serialization=True)
    return {"first": losses[0], "last": losses[-1]} if losses else {}


def export_check(trainer, tmp: Path, dtype: str) -> dict[str, float]:
    """One export in the server's dtype, read back with safetensors: every tensor equal to
    the trainer's own weights cast to that dtype."""
    import torch
    from safetensors.torch import load_file

    t = time.monotonic()
    trainer.export_weights(tmp, dtype)
    export_s = time.monotonic() - t
    saved = load_file(str(tmp / "model.safetensors"))
    own = trainer.full_weights("float32")
    target = getattr(torch, dtype)
    differ = [k for k in own if k not in saved
              or not torch.equal(saved[k], own[k].to(target))]
    return {"tensors": len(saved), "differing_tensors": len(differ) + len(set(saved) - set(own)),
            "bytes": (tmp / "model.safetensors").stat().st_size, "export_s": export_s}


def ipc_check(trainer, tmp: Path, dtype: str, bucket_mb: int) -> dict[str, object]:
    """Two syncs by ``inference.transfer_engine: ipc`` into ``bench.ipc_receiver --open
    cuda``, another process that maps each bucket's CUDA IPC export on this GPU as vLLM's
    engine does (no vLLM on the check's machine); what it received must equal the export
    (``export_check`` wrote it first)."""
    import subprocess

    import torch
    from safetensors.torch import load_file

    from bench.gateway import wait_http
    from bench.stack import free_port

    port, folder = free_port(), tmp / "ipc"
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "bench.ipc_receiver", str(port),
                             str(folder), "auto", "--open", "cuda"])
    try:
        try:
            wait_http(url + "/health", 120)
        except TimeoutError:
            return {"error": "bench.ipc_receiver did not start"}
        seconds = []
        for _ in range(2):  # the second without the first's CUDA IPC set-up
            # a minute, not the load's usual bound: a hang must leave the check's other
            # figures time to come back
            sent = trainer.transfer_weights([url], dtype, bucket_mb << 20, 60, None,
                                            engine="ipc")
            if sent.loaded != [url]:
                return {"error": f"the receiver did not load: {sent.failed}"}
            seconds.append(sent.seconds)
    finally:
        proc.kill()
        proc.wait()
    got = tensors(folder)
    saved = load_file(str(tmp / "export" / "model.safetensors"))
    differ = [k for k in saved if k not in got or not torch.equal(got[k], saved[k])]
    return {"sync_s": seconds, "bytes": sent.bytes_moved, "buckets": sent.buckets,
            "bucket_mb": bucket_mb, "tensors": len(got),
            "differing_tensors": len(differ) + len(set(got) - set(saved))}


def tensors(folder: Path) -> dict:
    """Every tensor of the safetensors files in ``folder``, by name."""
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors"))
            for k, v in load_file(str(f)).items()}


def changed_tensors(initial: Path, exported: Path) -> int:
    """How many of the export's tensors differ from the initial model's (both bf16)."""
    import torch

    before, after = tensors(initial), tensors(exported)
    return sum(1 for k, v in after.items() if k in before and not torch.equal(before[k], v))


class Progress:
    """The figures so far, written after each phase to ``$OUT/gpu_trainer.partial.json``
    (when ``$OUT`` is set): a crash or a hang late in the check leaves the earlier ones."""

    def __init__(self) -> None:
        out = os.environ.get("OUT")
        self.path = Path(out) / "gpu_trainer.partial.json" if out else None
        self.figures: dict = {}

    def note(self, **figures: object) -> None:
        self.figures.update(figures)
        if self.path is not None:
            self.path.write_text(json.dumps(self.figures, indent=1, default=str))


def thresholds(result: dict, args: argparse.Namespace) -> list[str]:
    """The figures that fail the check, one line each."""
    failed = []
    gap = result["logprob_gap_engine_vs_hf"]["mean"]
    if not gap < args.max_gap:
        failed.append(f"logprob_gap_engine_vs_hf.mean {gap:.4f} is not below --max-gap "
                      f"{args.max_gap}")
    if result["skipped_steps"]:
        failed.append(f"skipped_steps {result['skipped_steps']:.0f}: a non-finite gradient")
    if result["export"]["differing_tensors"]:
        failed.append(f"export: {result['export']['differing_tensors']} tensors differ from "
                      "the trainer's weights")
    ipc = result.get("ipc") or {}
    if "error" in ipc or ipc.get("differing_tensors"):
        failed.append(f"ipc: {ipc.get('error') or ipc['differing_tensors']} "
                      "(tensors received by CUDA IPC that differ from the export)")
    if result["trained_tokens_per_s"] < args.min_tokens_per_s:
        failed.append(f"trained_tokens_per_s {result['trained_tokens_per_s']:.0f} is below "
                      f"--min-tokens-per-s {args.min_tokens_per_s}")
    returned = result["memory_returned_gib"]
    if returned < args.min_offload_gib:
        failed.append(f"memory_returned_gib {returned:.2f} (the update's peak less what the "
                      f"trainer holds when the KV cache wakes) is below --min-offload-gib "
                      f"{args.min_offload_gib}")
    resident = result["resident_at_kv_cache_wake_gib"]
    if result["device"] == "cuda" and args.max_resident_gib is not None \
            and resident > args.max_resident_gib:
        failed.append(f"resident_at_kv_cache_wake_gib {resident:.2f} is above "
                      f"--max-resident-gib {args.max_resident_gib}")
    sft = result["sft_loss"]
    if sft and not sft["last"] < args.max_sft_loss:
        failed.append(f"sft_loss.last {sft['last']:.2f} is not below {args.max_sft_loss:.2f}: "
                      "the model's logits are not peaked, and the log-prob gap means little")
    if not result["export"]["changed_tensors"]:
        failed.append("export: no tensor differs from the initial model's (the updates moved "
                      "nothing, or the export is stale)")
    kl = result["kl_loss"]
    if result["use_kl_loss"] and len(kl) > 1 and not kl[-1] > 0:
        failed.append(f"kl_loss {kl}: no KL after the actor moved (the reference path)")
    return failed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="CPU-sized model and batch (CI)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--response-len", type=int, default=256)
    ap.add_argument("--micro", type=int, default=4, help="ppo_micro_batch_size_per_gpu")
    ap.add_argument("--kl", action="store_true", help="the reference and its KL loss")
    ap.add_argument("--dynamic-bsz", action="store_true", help="micro-batches by tokens")
    ap.add_argument("--offload", action="store_true",
                    help="fsdp_config param_offload and optimizer_offload")
    ap.add_argument("--sft-steps", type=int, default=None,
                    help="to give the model peaked logits (default 150 with --tiny, else 40)")
    ap.add_argument("--max-gap", type=float, default=0.05,
                    help="fail above this mean |engine - HF| log-prob gap (bf16 compute)")
    ap.add_argument("--min-tokens-per-s", type=float, default=0.0)
    ap.add_argument("--min-offload-gib", type=float, default=0.0,
                    help="fail if the update's peak less what the trainer holds when the KV "
                         "cache wakes is below this (GPU)")
    ap.add_argument("--max-resident-gib", type=float, default=None,
                    help="fail if the trainer holds more accelerator memory than this when "
                         "the KV cache wakes (GPU; default 1 with --offload, whose state is "
                         "then on the host: the check of the offload itself)")
    ap.add_argument("--max-sft-loss", type=float, default=None,
                    help="fail if the SFT ends above this (default 0.6 x ln of the pattern's "
                         "ids: logits not peaked)")
    ap.add_argument("--lr", type=float, default=1e-5,
                    help="the updates' learning rate (large enough that bf16 weights move)")
    ap.add_argument("--ipc", action="store_true",
                    help="two weight syncs by CUDA IPC into a second process (GPU)")
    ap.add_argument("--bucket-mb", type=int, default=256, help="the --ipc bucket")
    ap.add_argument("--out", default=None, help="where the model is built (default: a temp dir)")
    args = ap.parse_args(argv)
    if args.tiny:
        args.groups, args.n, args.prompt_len, args.response_len = 4, 4, 24, 16
    if args.sft_steps is None:
        args.sft_steps = 150 if args.tiny else 40
    shape = TINY if args.tiny else QWEN25_05B
    if args.max_resident_gib is None and args.offload:
        args.max_resident_gib = 1.0
    if args.max_sft_loss is None:
        args.max_sft_loss = 0.6 * math.log(min(shape["vocab_size"], PATTERN_IDS))
    progress = Progress()

    import torch

    from app.config import load_config
    from bench.reference import token_log_probs
    from workers.trainer.batch import Sample, to_batch
    from workers.trainer.engine import EngineTrainer
    from workers.trainer.verl_batch import to_verl_batch

    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    progress.note(device=device, torch=torch.__version__, cuda=torch.version.cuda)
    out = Path(args.out or tempfile.mkdtemp(prefix="carryover-gpu-")) / "qwen2.5-shaped"
    t = time.monotonic()
    sft: dict[str, float] = {}
    if not (out / "config.json").exists():
        sft = build_model(out, shape, args.sft_steps, device)
    build_s = time.monotonic() - t
    progress.note(sft_loss=sft, build_model_s=build_s)

    actor = "actor_rollout_ref.actor."
    tokens_per_row = args.prompt_len + args.response_len
    cfg = load_config(None, [
        f"trainer.device={device}", f"{actor}lr={args.lr}",
        f"{actor}fsdp_config.param_dtype=bfloat16",
        f"{actor}ppo_micro_batch_size_per_gpu={args.micro}",
        f"{actor}enable_gradient_checkpointing=true",
        f"{actor}use_kl_loss={str(args.kl).lower()}",
        f"{actor}use_dynamic_bsz={str(args.dynamic_bsz).lower()}",
        # room for the micro-batch's rows by tokens, so the two cuts are comparable
        f"{actor}ppo_max_token_len_per_gpu={args.micro * tokens_per_row}",
        f"{actor}fsdp_config.param_offload={str(args.offload).lower()}",
        f"{actor}fsdp_config.optimizer_offload={str(args.offload).lower()}",
        f"trainer.total_steps={args.steps}"])
    t = time.monotonic()
    trainer = EngineTrainer(cfg, str(out))
    engine_build_s = time.monotonic() - t
    progress.note(build_engine_s=engine_build_s)

    rng = random.Random(0)
    vocab = shape["vocab_size"]
    samples = []
    for g in range(args.groups):
        # patterned text, as the model was tuned on: its log-probs are peaked, not uniform
        prompt = patterned(rng, vocab, args.prompt_len)
        for _ in range(args.n):
            resp = patterned(rng, vocab, args.response_len + 1)[1:]
            samples.append(Sample(prompt, resp, [0.0] * len(resp), rng.random(), f"g{g}",
                                  1.0, 0))
    vb = to_verl_batch(samples, trainer.pad_id)
    engine_lp = trainer.log_probs(vb)
    for i, s in enumerate(samples):  # behaviour log-probs = the engine's: on-policy
        s.rollout_logprobs = engine_lp[i][: len(s.response_ids)].tolist()
    vb = to_verl_batch(samples, trainer.pad_id)

    # The engine's forward against a plain Hugging Face forward of the same (initial) weights,
    # in fp32: what bf16 compute costs in log-prob accuracy.
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).to(device).eval()
    with torch.no_grad():
        plain = torch.cat([token_log_probs(hf, to_batch(samples[i:i + 8], 0, device))[0].cpu()
                           for i in range(0, len(samples), 8)])
    n_params = sum(p.numel() for p in hf.parameters())
    del hf
    mask = vb.response_mask > 0
    gap = (engine_lp[mask] - plain[:, : engine_lp.shape[1]][mask]).abs()
    progress.note(logprob_gap_engine_vs_hf={"mean": float(gap.mean()), "max": float(gap.max())})

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, skipped, kl = [], 0.0, []
    tokens = float(vb.response_mask.sum())
    for step in range(args.steps):
        t = time.monotonic()
        m = trainer.update(vb, step)
        times.append(time.monotonic() - t)
        skipped += m["actor/skipped_steps"]
        kl += [v for k, v in m.items() if k.split("/")[-1] == "kl_loss"]
        progress.note(update_seconds=times, skipped_steps=skipped, kl_loss=kl)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0
    timed = times[1:] or times  # the first update pays for warm-up
    master = trainer.ranks.call("master_dtype")[0]
    # the trainer's half of the collocated hand-over, as a step runs it
    memory = trainer.memory("after_update")
    exported = export_check(trainer, out.parent / "export", "bfloat16")
    exported["changed_tensors"] = changed_tensors(out, out.parent / "export")
    progress.note(export=exported)
    ipc: dict[str, object] | None = None
    if args.ipc:
        ipc = ipc_check(trainer, out.parent, "bfloat16", args.bucket_mb) \
            if device == "cuda" else {"skipped": "CUDA IPC needs a GPU"}
        progress.note(ipc=ipc)
    memory.update(trainer.release_memory("before_weights_wake", offload=False))
    memory.update(trainer.release_memory("before_kv_cache_wake", offload=True))
    trainer.close()
    # what the trainer holds when the engine's KV cache wakes (verl's engine has already
    # parked what fsdp_config offloads when its update ended)
    after = memory["memory/trainer_rank0_before_kv_cache_wake_allocated_gb"] * 1e9 / 2**30

    result = {
        "benchmark": "gpu_trainer", "device": device,
        "device_name": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "model": "tiny" if args.tiny else "qwen2.5-0.5b-shaped (random weights, tied)",
        "parameters": n_params,
        "rows": len(vb), "trained_tokens_per_update": tokens, "steps": args.steps,
        "micro_batch_size_per_gpu": args.micro, "gradient_checkpointing": True,
        "use_kl_loss": args.kl, "kl_loss": kl, "use_dynamic_bsz": args.dynamic_bsz,
        "offload": args.offload, "sft_loss": sft,
        "compute_dtype": "bfloat16", "master_dtype": master,
        "update_seconds": times,
        "trained_tokens_per_s": tokens / statistics.median(timed),
        "peak_memory_gib": peak,
        "memory_gb": {k.removeprefix("memory/trainer_rank0_"): v for k, v in memory.items()},
        "memory_returned_gib": peak - after if device == "cuda" else 0.0,
        "resident_at_kv_cache_wake_gib": after if device == "cuda" else 0.0,
        "lr": args.lr,
        "export": exported, "ipc": ipc,
        "logprob_gap_engine_vs_hf": {"mean": float(gap.mean()), "max": float(gap.max())},
        "skipped_steps": skipped,
        "build_model_s": build_s, "build_engine_s": engine_build_s,
        "verl_platform": os.environ.get("VERL_PLATFORM", "auto"),
    }
    failed = thresholds(result, args)
    result["failed"] = failed
    progress.note(**result)
    print(json.dumps(result, indent=1))
    for line in failed:
        print(f"gpu_trainer: FAILED {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

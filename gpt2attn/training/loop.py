"""The training loop behind `gpt2attn train`: nanoGPT's recipe on the HF-layout GPT-2.

out_dir gets data/ (token files), checkpoints/step_NNNNNNN (HF model folder, tokenizer.json and
training_state.pt; each appears whole, see save_checkpoint), model/ (the final model and its
tokenizer.json), metrics.jsonl and loss.png.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import cpu
from ..config import GPT2Config
from ..errors import CheckpointError
from ..files import link_or_copy, remove_tree, replace_folder, write_atomic, write_text_atomic
from ..formats.hf import write_model
from ..formats.state_dict import torch_load
from ..model import GPT2LMHeadModel
from . import distributed
from .config import TrainConfig
from .data import TokenData, prepare_data

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of update `step` (from 0): linear warmup, then cosine down to min_lr."""
    if step < cfg.warmup_iters:
        return cfg.learning_rate * (step + 1) / (cfg.warmup_iters + 1)
    if step >= cfg.lr_decay_iters:
        return cfg.min_lr
    progress = (step - cfg.warmup_iters) / max(1, cfg.lr_decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.learning_rate - cfg.min_lr)


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run cfg; returns the last step, losses and wall time."""
    cfg.validate()
    info, device = distributed.setup(cfg.device)
    try:
        return _train(cfg, info, device)
    finally:
        distributed.cleanup(info)


def _train(cfg: TrainConfig, info: distributed.Dist, device: torch.device) -> dict[str, Any]:
    # gradient_accumulation_steps counts the micro-batches of all processes together; under
    # torchrun it is rounded up to a multiple of the number of processes.
    local_accum = math.ceil(cfg.gradient_accumulation_steps / info.world_size)
    accum = local_accum * info.world_size
    if info.is_main:
        if accum != cfg.gradient_accumulation_steps:
            warnings.warn(f"gradient_accumulation_steps ({cfg.gradient_accumulation_steps}) is not a multiple of the "
                          f"{info.world_size} processes: each update takes {accum} micro-batches, {local_accum} per process")
        if cfg.max_iters < cfg.warmup_iters:
            warnings.warn(f"max_iters ({cfg.max_iters}) < warmup_iters ({cfg.warmup_iters}): the run ends during the "
                          f"warmup, before the learning rate reaches {cfg.learning_rate:g}")
    out_dir = Path(cfg.out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"out_dir {out_dir} is a file, not a folder")
    started = time.perf_counter()

    # Data: tokenized once by the main process, memory-mapped by all.
    checkpoint = latest_checkpoint(out_dir) if cfg.resume else None
    if cfg.resume and checkpoint is None:
        raise FileNotFoundError(f"--resume: no checkpoint in {out_dir / 'checkpoints'}")
    if not cfg.data:
        raise ValueError("no training text: set data = PATH in the config or pass --data=PATH")
    tokenizer = cfg.tokenizer or cfg.init_from
    error = None
    if info.is_main:
        try:
            # A resumed run keeps the vocabulary its checkpoint was trained with (its tokenizer.json).
            vocabulary = checkpoint / "tokenizer.json" if checkpoint is not None else None
            prepare_data(cfg.data, out_dir / "data", tokenizer, cfg.val_fraction, keep_vocabulary=vocabulary)
        except (ValueError, OSError) as e:
            error = e
    distributed.raise_together(error, info)
    data = TokenData(out_dir / "data", cfg.block_size)
    plot = cfg.plot and info.is_main and _can_plot()

    # Model: from scratch, from a pretrained source, or from the checkpoint.
    torch.manual_seed(cfg.seed)  # the same initial weights in every process
    model = build_model(cfg, data.vocab_size, checkpoint).to(device)
    torch.manual_seed(cfg.seed + info.rank)  # but each its own dropout masks
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    raw_model = model
    model = wrapped = distributed.wrap(model, info, device, cfg.fsdp)
    sharded = cfg.fsdp and info.enabled
    optimizer = raw_model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2), device.type)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, cfg) / cfg.learning_rate)
    batch_rng = torch.Generator().manual_seed(cfg.seed)  # the data position: same on every process
    step = 0
    if checkpoint is not None:
        state = read_training_state(checkpoint)
        if sharded:
            distributed.load_sharded_optimizer(wrapped, optimizer, state["optimizer"])
        else:
            optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        batch_rng.set_state(state["batch_rng"])
        torch.set_rng_state(state["torch_rng"][info.rank % len(state["torch_rng"])])
        if device.type == "cuda" and state.get("cuda_rng") is not None:
            torch.cuda.set_rng_state(state["cuda_rng"])
        step = state["step"]
    if cfg.compile:
        model = torch.compile(model)

    dtype = autocast_dtype(cfg.dtype, device, info.is_main)
    autocast = torch.autocast(device.type, dtype=DTYPES[dtype], enabled=dtype != "float32")
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == "float16" and device.type == "cuda")
    eval_rng = torch.Generator().manual_seed(cfg.seed + 1)
    eval_offsets = {split: data.offsets(split, cfg.eval_iters * cfg.batch_size, eval_rng) for split in ("train", "val")}

    def loss_of(x: Tensor, y: Tensor) -> Tensor:
        with autocast:
            logits = model(x.to(device), use_cache=False, return_dict=True).logits  # (B, T, V)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.to(device).reshape(-1))

    @torch.no_grad()
    def evaluate() -> dict[str, float]:
        """Mean loss over the same eval_iters batches of each split every time."""
        model.eval()
        losses = {}
        for split, offsets in eval_offsets.items():
            total = sum(loss_of(*data.batch(split, chunk)) for chunk in offsets.split(cfg.batch_size))
            losses[split] = (total / cfg.eval_iters).item()
        model.train()
        return losses

    metrics = MetricsLog(out_dir / "metrics.jsonl", keep_until=step, enabled=info.is_main)
    progress = _progress_bar(cfg, step, info.is_main)
    tokens_per_step = cfg.batch_size * cfg.block_size * accum
    last_log_time, last_log_step = time.perf_counter(), step
    loss_sum = torch.zeros((), device=device)
    row: dict[str, Any] = {}
    model.train()
    while step < cfg.max_iters:
        # One update over the global batch; this process takes its share of the micro-batches.
        offsets = data.offsets("train", accum * cfg.batch_size, batch_rng)
        mine = offsets.view(info.world_size, local_accum, cfg.batch_size)[info.rank]  # (L, B)
        lr = scheduler.get_last_lr()[0]
        for micro, micro_offsets in enumerate(mine):
            last = micro == local_accum - 1
            with contextlib.nullcontext() if last else distributed.no_gradient_sync(wrapped, info, cfg.fsdp):
                loss = loss_of(*data.batch("train", micro_offsets)) / local_accum
                scaler.scale(loss).backward()
            loss_sum += loss.detach()
        if cfg.grad_clip > 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(raw_model.parameters(), cfg.grad_clip, foreach=True)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        progress.update(1)

        eval_now = step % cfg.eval_interval == 0 or step == cfg.max_iters
        if step % cfg.log_interval == 0 or eval_now:
            now = time.perf_counter()
            train_loss = distributed.mean_over_processes(loss_sum, info).item() / (step - last_log_step)
            row = {"step": step, "train_loss": train_loss, "lr": lr,
                   "tokens_per_s": tokens_per_step * (step - last_log_step) / (now - last_log_time)}
            loss_sum.zero_()
            if eval_now:
                losses = evaluate()
                row.update(val_loss=losses["val"], eval_train_loss=losses["train"])
            metrics.write(row)
            progress.set_postfix(loss=f"{train_loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{row['tokens_per_s']:.0f}")
            if eval_now:
                weights, optimizer_state = (distributed.gather_full_state(wrapped, optimizer, raw_model) if sharded
                                            else (raw_model, optimizer.state_dict()))
                state = {"step": step, "optimizer": optimizer_state, "scheduler": scheduler.state_dict(),
                         "batch_rng": batch_rng.get_state(), "torch_rng": _gather_rng(info),
                         "cuda_rng": torch.cuda.get_rng_state() if device.type == "cuda" else None,
                         "train_config": cfg.to_dict()}
                if info.is_main:
                    save_checkpoint(out_dir, weights, state)
                distributed.barrier(info)
            last_log_time, last_log_step = time.perf_counter(), step
    progress.close()
    if not row and info.is_main:  # --resume of a run that had already finished: its last figures
        row = {k: v for r in read_metrics(metrics.path) for k, v in r.items()}

    model_dir = out_dir / "model"
    if info.is_main:
        publish_model(latest_checkpoint(out_dir), model_dir)
        if plot:
            plot_losses(metrics.path, out_dir / "loss.png")
    distributed.barrier(info)
    return {"step": step, "train_loss": row.get("train_loss"), "val_loss": row.get("val_loss"),
            "seconds": time.perf_counter() - started, "model_dir": str(model_dir)}


def _can_plot() -> bool:
    """loss.png needs matplotlib (the plot extra): check at the start, not after the run."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        warnings.warn("matplotlib is not installed, so loss.png will not be drawn "
                      "(pip install 'gpt2attn[plot]', or --plot=false to silence this)")
        return False
    return True


def autocast_dtype(dtype: str, device: torch.device, say: bool) -> str:
    """The autocast dtype to train in. "auto" is bfloat16 where the device multiplies it natively
    (a CPU with AMX or AVX512-BF16, a CUDA GPU that supports it) and float32 elsewhere; bfloat16
    asked for on a CPU without it runs (emulated, many times slower), with a warning that says so."""
    native, sentence = cpu.bf16_report() if device.type == "cpu" else (
        device.type == "cuda" and torch.cuda.is_bf16_supported(), f"{device.type} device")
    if dtype == "auto":
        dtype = "bfloat16" if native else "float32"
        if say:
            print(f"dtype auto: {dtype} ({sentence})")
    elif dtype == "bfloat16" and device.type == "cpu" and not native:
        warnings.warn(f"dtype bfloat16: {sentence}; dtype = \"auto\" picks float32 here", stacklevel=2)
    return dtype


def build_model(cfg: TrainConfig, vocab_size: int, checkpoint: Path | None) -> GPT2LMHeadModel:
    if checkpoint is not None or cfg.init_from != "scratch":
        model = GPT2LMHeadModel.from_pretrained(checkpoint or cfg.init_from)
        if model.config.vocab_size < vocab_size:
            raise ValueError(f"the data's tokenizer has {vocab_size} tokens, the model only {model.config.vocab_size}")
        if cfg.block_size > model.config.n_positions:
            raise ValueError(f"block_size {cfg.block_size} exceeds the model's n_positions {model.config.n_positions}")
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                module.p = cfg.dropout
        model.config.resid_pdrop = model.config.embd_pdrop = model.config.attn_pdrop = cfg.dropout
        return model
    config = GPT2Config(
        vocab_size=vocab_size, n_positions=cfg.block_size, n_embd=cfg.n_embd, n_layer=cfg.n_layer,
        n_head=cfg.n_head, resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
        bos_token_id=None, eos_token_id=None,
    )
    return GPT2LMHeadModel(config)


def _gather_rng(info: distributed.Dist) -> list[Tensor]:
    """Every process's CPU RNG state (dropout), so a resumed run draws the same masks."""
    state = torch.get_rng_state()
    if not info.enabled:
        return [state]
    states = [None] * info.world_size
    torch.distributed.all_gather_object(states, state)
    return states


def _progress_bar(cfg: TrainConfig, step: int, is_main: bool):
    from tqdm import tqdm

    return tqdm(total=cfg.max_iters, initial=step, disable=not (cfg.progress and is_main), unit="step", dynamic_ncols=True)


# --- checkpoints ----------------------------------------------------------------------


TRAINING_STATE = "training_state.pt"
STATE_KEYS = ("step", "optimizer", "scheduler", "batch_rng", "torch_rng")


def save_checkpoint(out_dir: Path, model: GPT2LMHeadModel, state: dict[str, Any]) -> Path:
    """checkpoints/step_NNNNNNN: the model, its tokenizer.json and training_state.pt, written as
    one folder by replace_folder, so that a step_ folder is complete from the instant it exists.
    Then the older ones are removed (renamed away first, so never seen half-deleted)."""
    root = out_dir / "checkpoints"
    final = root / f"step_{state['step']:07d}"
    with replace_folder(final) as folder:
        write_model(model, folder)
        link_or_copy(out_dir / "data" / "tokenizer.json", folder / "tokenizer.json")
        write_atomic(folder / TRAINING_STATE, lambda f: torch.save(state, f))
    for old in root.iterdir():
        if old != final:
            remove_tree(old)
    return final


def latest_checkpoint(out_dir: Path) -> Path | None:
    """The newest checkpoint (highest step) in out_dir/checkpoints, or None."""
    root = out_dir / "checkpoints"
    steps = [p for p in root.iterdir() if re.fullmatch(r"step_\d+", p.name) and p.is_dir()] if root.is_dir() else []
    return max(steps, key=lambda p: int(p.name.removeprefix("step_")), default=None)


def read_training_state(checkpoint: Path) -> dict[str, Any]:
    """A checkpoint's training_state.pt; errors name the file (missing, truncated, refused)."""
    path = checkpoint / TRAINING_STATE
    state = torch_load(path)
    missing = [key for key in STATE_KEYS if not isinstance(state, dict) or key not in state]
    if missing:
        raise CheckpointError(path, f"not a gpt2attn training state (no {', '.join(missing)})")
    return state


def publish_model(checkpoint: Path, model_dir: Path) -> None:
    """out_dir/model: the checkpoint's model and tokenizer.json, replacing the last one in one step."""
    with replace_folder(model_dir) as folder:
        for file in checkpoint.iterdir():
            if file.name != TRAINING_STATE:
                link_or_copy(file, folder / file.name)


# --- metrics --------------------------------------------------------------------------


class MetricsLog:
    """metrics.jsonl: one JSON object per logged step. A resumed run first drops the rows
    written after its checkpoint, so the file reads as one uninterrupted run."""

    def __init__(self, path: Path, keep_until: int, enabled: bool):
        self.path = path
        self.enabled = enabled
        if enabled:
            rows = read_metrics(path) if keep_until > 0 else []
            kept = "".join(json.dumps(r) + "\n" for r in rows if r["step"] <= keep_until)
            write_text_atomic(path, kept)

    def write(self, row: dict[str, Any]) -> None:
        if self.enabled:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def plot_losses(metrics_path: Path, png_path: Path) -> None:
    """loss.png: train loss per logged step, val loss per eval step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows], [r["train_loss"] for r in rows], label="train (batch)", lw=1)
    evals = [r for r in rows if "val_loss" in r]
    ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", label="val")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    try:
        write_atomic(png_path, lambda f: fig.savefig(f, format="png", dpi=100))
    finally:
        plt.close(fig)

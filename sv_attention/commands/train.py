"""``sv-attention train``: train the byte-level model (one operator, or several twins side by side).

Examples::

    sv-attention train --operator sv --steps 300 --run-dir runs/sv
    sv-attention train --operators sv softmax swa --preset paper --steps 2000 --run-dir runs/twins \\
        --json results/train_twins.json
    torchrun --nproc_per_node 2 -m sv_attention.cli train --operator softmax --cpu   # 2 CPU processes
    accelerate launch -m sv_attention.cli train --operator sv                         # GPUs
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from typing import Any

COMMAND = "train"
HELP = "train the byte-level model with accelerate (AdamW, cosine schedule, eval bits-per-byte, checkpoints)"

PRESETS: dict[str, dict[str, Any]] = {
    # the quickstart size: ~0.2M parameters, minutes on 2 CPU cores
    "tiny": {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "block_size": 128},
    # the published backbone: 3,220,992 parameters excluding the tied head
    "paper": {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "block_size": 256},
}

# flag -> TrainConfig field (flags use the usual spellings)
_FLAG_FIELDS = {
    "dataset": "dataset", "dataset_config": "dataset_config", "dataset_split": "dataset_split",
    "text_column": "text_column", "embedded_bytes": "embedded_bytes", "data_seed": "data_seed",
    "max_bytes": "max_bytes", "val_fraction": "val_fraction", "model_family": "model_family",
    "hidden_size": "hidden_size", "layers": "num_layers", "heads": "num_heads", "block_size": "block_size",
    "dropout": "dropout", "steps": "steps", "batch_size": "batch_size", "lr": "lr", "min_lr_ratio": "min_lr_ratio",
    "warmup_steps": "warmup_steps", "weight_decay": "weight_decay", "grad_clip": "grad_clip",
    "eval_every": "eval_every", "eval_bytes": "eval_bytes", "eval_batch_size": "eval_batch_size",
    "log_every": "log_every", "save_every": "save_every", "seed": "seed", "run_dir": "run_dir",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("what to train")
    g.add_argument("--operator", default=None, help="attention operator (sv, softmax, swa, ceq, ceq_path_sum, smprime)")
    g.add_argument("--operators", nargs="+", default=None, metavar="OP",
                   help="train several twins (same backbone, data, budget) side by side, e.g. sv softmax swa; "
                        "swa gets the SV local window")
    g.add_argument("--knob", action="append", default=[], metavar="NAME=VALUE",
                   help="operator knob, e.g. --knob chunk=32 --knob nu=0.5 (values parsed as JSON)")
    g.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="model size preset: tiny (quickstart) or paper (d256, 4 layers, 4 heads, block 256)")
    g.add_argument("--model-family", choices=["sv", "gpt2"], default=None,
                   help="sv (the repository's model, default) or gpt2 (stock transformers reference)")
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--layers", type=int, default=None)
    g.add_argument("--heads", type=int, default=None)
    g.add_argument("--block-size", type=int, default=None, help="context length in bytes")
    g.add_argument("--dropout", type=float, default=None)
    d = parser.add_argument_group("data")
    d.add_argument("--dataset", default=None,
                   help="'embedded' (default: generated stories), a text file / directory / glob, or a Hub name")
    d.add_argument("--dataset-config", default=None)
    d.add_argument("--dataset-split", default=None)
    d.add_argument("--text-column", default=None)
    d.add_argument("--embedded-bytes", type=int, default=None, help="size of the embedded corpus (default 4 MB)")
    d.add_argument("--data-seed", type=int, default=None)
    d.add_argument("--max-bytes", type=int, default=None)
    d.add_argument("--val-fraction", type=float, default=None, help="contiguous validation tail (default 0.05)")
    o = parser.add_argument_group("optimisation")
    o.add_argument("--steps", type=int, default=None)
    o.add_argument("--batch-size", type=int, default=None, help="global batch (sequences per step)")
    o.add_argument("--lr", type=float, default=None)
    o.add_argument("--min-lr-ratio", type=float, default=None)
    o.add_argument("--warmup-steps", type=int, default=None)
    o.add_argument("--weight-decay", type=float, default=None)
    o.add_argument("--grad-clip", type=float, default=None)
    o.add_argument("--seed", type=int, default=None)
    r = parser.add_argument_group("run")
    r.add_argument("--run-dir", default=None, help="output folder (default runs/train)")
    r.add_argument("--config", default=None, help="a TrainConfig JSON (e.g. a run's train_config.json); flags override it")
    r.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --run-dir")
    r.add_argument("--eval-every", type=int, default=None)
    r.add_argument("--eval-bytes", type=int, default=None)
    r.add_argument("--eval-batch-size", type=int, default=None)
    r.add_argument("--log-every", type=int, default=None)
    r.add_argument("--save-every", type=int, default=None)
    r.add_argument("--cpu", action="store_true", help="stay on the CPU even when an accelerator is present")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.add_argument("--parallel", action="store_true",
                   help="with --operators: train the twins at once, one subprocess each (OMP_NUM_THREADS=1 "
                        "unless set)")
    r.add_argument("--json", default=None,
                   help="also write the summary through sv_attention.results (default for --operators: "
                        "results/train_twins.json)")


def _knobs(items: list[str]) -> dict[str, Any]:
    from sv_attention.errors import ConfigError

    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--knob expects NAME=VALUE, got {item!r}")
        name, raw = item.split("=", 1)
        try:
            out[name] = json.loads(raw)
        except json.JSONDecodeError:
            out[name] = raw
    return out


def config_from_args(args: argparse.Namespace) -> Any:
    """The :class:`TrainConfig` the flags describe (``--config`` file, then ``--preset``, then flags)."""
    from sv_attention.errors import ConfigError
    from sv_attention.train.config import TrainConfig

    base: dict[str, Any] = TrainConfig.load(args.config).to_json() if args.config else {}
    if args.preset:
        base.update(PRESETS[args.preset])
    for flag, fld in _FLAG_FIELDS.items():
        v = getattr(args, flag, None)
        if v is not None:
            base[fld] = v
    if args.cpu:
        base["cpu"] = True
    if args.operator and args.operators:
        raise ConfigError("give --operator or --operators, not both")
    ops = args.operators or ([args.operator] if args.operator else None)
    if ops:
        base["operator"] = ops[0]
    knobs = _knobs(args.knob)
    if knobs:
        base["operator_config"] = knobs
    elif args.operator and not args.config:
        base["operator_config"] = {}
    known = {f.name for f in fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in base.items() if k in known})


def _print_table(rows: list[tuple[str, Any, Any, Any, Any]]) -> None:
    print(f"{'operator':<14}{'val bpb':>10}{'train loss':>12}{'tokens/s':>12}  checkpoint")
    for op, bpb, loss, tps, ck in rows:
        print(f"{op:<14}{bpb:>10.4f}{loss:>12.4f}{tps:>12,.0f}  {ck}")


def run(args: argparse.Namespace) -> int:
    from sv_attention.errors import SVAttentionError
    from sv_attention.results import write_result
    from sv_attention.train.loop import train
    from sv_attention.train.twins import (
        interleaved_throughput,
        train_twins,
        train_twins_parallel,
        twins_summary,
    )

    try:
        cfg = config_from_args(args)
        if args.operators and len(args.operators) > 1:
            if args.parallel:
                results = train_twins_parallel(cfg, list(args.operators), resume=args.resume)
            else:
                results = train_twins(cfg, list(args.operators), progress=not args.no_progress, resume=args.resume)
            if not _is_main():
                return 0
            _print_table([(op, r.val_bpb, r.train_loss, r.tokens_per_s, r.checkpoint) for op, r in results.items()])
            payload = twins_summary(results, interleaved_throughput(results))
            if "throughput_ratio_sv_over_softmax" in payload:
                print(f"throughput SV / softmax: {payload['throughput_ratio_sv_over_softmax']:.3f}")
            path = write_result("train_twins", payload, path=args.json)
            print(f"wrote {path}")
            return 0
        res = train(cfg, resume=args.resume, progress=not args.no_progress)
        if not _is_main():
            return 0
        _print_table([(cfg.operator if cfg.model_family == "sv" else cfg.model_family, res.val_bpb, res.train_loss,
                       res.tokens_per_s, res.checkpoint)])
        print(f"log: {res.run_dir / 'log.jsonl'}   summary: {res.run_dir / 'run.json'}")
        if args.json:
            print(f"wrote {write_result('train', res.summary, path=args.json)}")
        return 0
    except SVAttentionError as exc:
        print(f"sv-attention train: error: {exc}", file=sys.stderr)
        return 2


def _is_main() -> bool:
    from accelerate import PartialState

    return PartialState().is_main_process

"""``shardwise export`` and ``shardwise inspect``: checkpoints without a training script.

    shardwise inspect checkpoints/                 the checkpoint ``latest`` names
    shardwise inspect checkpoints/global_step100 --verify
    shardwise export checkpoints/ model.safetensors [--tag global_step100] [--fp32]
    shardwise checkpoint inspect DIR [--tag T]     any format: what it is, what a load takes

CHECKPOINT_DIR is a save directory (with ``latest``) or one checkpoint's directory.
"""

from __future__ import annotations

import argparse

from shardwise.checkpoint.export import export_consolidated, inspect
from shardwise.checkpoint.foreign.summary import summary


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export", help="write a checkpoint's model weights to one plain safetensors file"
    )
    p.add_argument("checkpoint_dir", help="save directory (with 'latest') or checkpoint directory")
    p.add_argument("out", help="the .safetensors file to write")
    p.add_argument("--tag", default=None, help="checkpoint tag inside CHECKPOINT_DIR")
    p.add_argument(
        "--fp32", action="store_true", help="export the fp32 master weights (when saved)"
    )
    p = sub.add_parser("inspect", help="print a checkpoint's layout, step, tensors and sizes")
    p.add_argument("checkpoint_dir", help="save directory (with 'latest') or checkpoint directory")
    p.add_argument("--tag", default=None, help="checkpoint tag inside CHECKPOINT_DIR")
    p.add_argument(
        "--verify", action="store_true", help="also read every tensor and check its checksum"
    )
    p = sub.add_parser("checkpoint", help="checkpoints of any format (shardwise, DeepSpeed)")
    action = p.add_subparsers(dest="action", required=True)
    p = action.add_parser(
        "inspect", help="the format found, the layout that saved it, what a load takes or drops"
    )
    p.add_argument("checkpoint_dir", help="save directory (with 'latest') or checkpoint directory")
    p.add_argument("--tag", default=None, help="checkpoint tag inside CHECKPOINT_DIR")


def run(args: argparse.Namespace) -> str:
    """The text the command prints (errors raise CheckpointError, a ValueError)."""

    if args.command == "checkpoint":
        return summary(args.checkpoint_dir, tag=args.tag)
    if args.command == "inspect":
        return inspect(args.checkpoint_dir, tag=args.tag, verify=args.verify)
    names = export_consolidated(
        args.checkpoint_dir, args.out, dtype="fp32" if args.fp32 else None, tag=args.tag
    )
    return f"wrote {len(names)} tensors to {args.out}"

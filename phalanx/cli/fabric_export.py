"""``phalanx fabric export``: write a fabric file (Slurm topology.conf in tree or block syntax, or Phalanx YAML) in
another format, offline (no services). Slurm block syntax (``BlockName=``/``BlockSizes=``) is what Slurm's
``--segment`` and GB200 NVL72 racks use: NVLink domains become blocks, the switches above them aggregates.

    phalanx fabric export --fabric fabric.yaml --format slurm-block > topology.conf
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from phalanx.core.fabric import (
    Fabric,
    FabricError,
    group_nvlink_domains,
    load_fabric,
    to_slurm_block,
    to_slurm_tree,
)

from . import console
from .common import EXIT_OK, EXIT_USAGE

FORMATS = ("slurm-block", "slurm-tree", "yaml")


def export_fabric(fabric: Fabric, fmt: str) -> str:
    """The fabric as text in `fmt` (one of FORMATS)."""
    if fmt == "slurm-block":
        return to_slurm_block(fabric)
    if fmt == "slurm-tree":
        return to_slurm_tree(fabric)
    return fabric.to_yaml()


def cmd_fabric_export(args: argparse.Namespace) -> int:
    try:
        if not Path(args.fabric).is_file():
            raise FabricError(f"fabric file {args.fabric} does not exist")
        fabric = load_fabric(args.fabric)
        if not fabric.paths:
            raise FabricError(f"fabric {args.fabric} names no nodes")
        if args.nvlink_domain_nodes:
            fabric = group_nvlink_domains(fabric, args.nvlink_domain_nodes)
        text = export_fabric(fabric, args.format)
    except (FabricError, OSError, UnicodeDecodeError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        sys.stderr.flush()
        return EXIT_USAGE
    console.emit(text)
    return EXIT_OK


def register(subparsers) -> None:
    """Add ``fabric export`` to the ``phalanx`` CLI."""
    p = subparsers.add_parser("fabric", help="fabric files: export one in another format (offline)")
    sub = p.add_subparsers(dest="fabric_command", metavar="COMMAND")
    sub.required = True
    ex = sub.add_parser(
        "export",
        help="write a fabric file as Slurm block or tree syntax, or Phalanx YAML",
        description="Read a fabric file (Slurm topology.conf in tree or block syntax, or Phalanx YAML) and print it "
        "in another format. slurm-block writes the lowest tier's domains (NVLink domains where the fabric has them, "
        "else leaves) as blocks and the tiers above as BlockSizes aggregates while they are uniform.",
    )
    ex.add_argument("--fabric", required=True, metavar="FILE", help="fabric file: Slurm topology.conf or Phalanx YAML")
    ex.add_argument("--format", choices=FORMATS, default="slurm-block", help="output format (default: slurm-block)")
    ex.add_argument(
        "--nvlink-domain-nodes",
        type=int,
        default=0,
        metavar="N",
        help="group the nodes of each leaf into NVLink domains of N consecutive nodes first (as gb200-nvl72 agents "
        "report them), when the file declares none",
    )
    ex.set_defaults(func=cmd_fabric_export)

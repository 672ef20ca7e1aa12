"""The inter-node fabric: which switch of each tier every node sits under.

A fabric is static structure: tier names from the lowest switch tier up (for a Slurm tree: `leaf`, `spine`, `core`,
then `tier3`, `tier4`, ...; for Slurm block syntax: `block`, `block2`, ...) and, per node, its switches from the leaf
up. Read it from a Slurm `topology.conf` in tree or block syntax or from Phalanx's own YAML; nodes the fabric does not
name sit directly under the cluster root.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .hostlist import expand_hostlist

TREE_TIER_NAMES = ("leaf", "spine", "core")


def tree_tier_name(level: int) -> str:
    """Name of switch level `level` (0 = switches that list Nodes=) in a Slurm tree file."""
    return TREE_TIER_NAMES[level] if level < len(TREE_TIER_NAMES) else f"tier{level}"


@dataclass(frozen=True)
class Fabric:
    tiers: tuple[str, ...] = ()
    paths: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def path(self, node: str) -> tuple[str, ...]:
        return tuple(self.paths.get(node, ()))

    def to_yaml(self) -> str:
        return yaml.safe_dump({"tiers": list(self.tiers), "nodes": {n: list(p) for n, p in self.paths.items()}})


class FabricError(ValueError):
    """A fabric description that cannot be read; the message says where."""


def parse_slurm_tree(text: str) -> Fabric:
    """Parse Slurm topology.conf tree syntax (`SwitchName=s0 Nodes=dgx[01-04]`, `SwitchName=s1 Switches=s[0-1]`)."""
    nodes_of: dict[str, list[str]] = {}
    children_of: dict[str, list[str]] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = dict(_key_values(line, lineno))
        name = fields.get("switchname")
        if not name:
            if "blockname" in fields:
                raise FabricError(f"line {lineno}: block topology (BlockName=) is not supported yet; use tree syntax")
            raise FabricError(f"line {lineno}: expected SwitchName=..., got {raw.strip()!r}")
        if name in nodes_of or name in children_of:
            raise FabricError(f"line {lineno}: switch {name!r} is defined twice")
        try:
            if "nodes" in fields:
                nodes_of[name] = expand_hostlist(fields["nodes"])
            if "switches" in fields:
                children_of[name] = expand_hostlist(fields["switches"])
        except ValueError as exc:
            raise FabricError(f"line {lineno}: {exc}") from exc
        if "nodes" not in fields and "switches" not in fields:
            raise FabricError(f"line {lineno}: switch {name!r} lists neither Nodes= nor Switches=")

    parent: dict[str, str] = {}
    for sw, kids in children_of.items():
        for kid in kids:
            if kid not in nodes_of and kid not in children_of:
                raise FabricError(f"switch {sw!r} lists unknown switch {kid!r}")
            if kid in parent:
                raise FabricError(f"switch {kid!r} has two parents ({parent[kid]!r} and {sw!r})")
            parent[kid] = sw

    level: dict[str, int] = {}

    def level_of(sw: str, seen: tuple[str, ...] = ()) -> int:
        if sw in seen:
            raise FabricError(f"switch cycle through {sw!r}")
        if sw not in level:
            kids = children_of.get(sw, [])
            level[sw] = 0 if not kids else 1 + max(level_of(k, seen + (sw,)) for k in kids)
        return level[sw]

    for sw in {*nodes_of, *children_of}:
        level_of(sw)

    paths: dict[str, tuple[str, ...]] = {}
    for leaf, members in nodes_of.items():
        chain = [leaf]
        while chain[-1] in parent:
            chain.append(parent[chain[-1]])
        # Pad skipped levels (a leaf hanging straight off a core switch) so tier i is always path[i].
        padded: list[str] = []
        for sw in chain:
            while len(padded) < level[sw]:
                padded.append(padded[-1] if padded else sw)
            padded.append(sw)
        for node in members:
            if node in paths:
                raise FabricError(f"node {node!r} is listed under two leaf switches")
            paths[node] = tuple(padded)
    depth = max((len(p) for p in paths.values()), default=0)
    return Fabric(tiers=tuple(tree_tier_name(i) for i in range(depth)), paths=paths)


def parse_slurm_block(text: str) -> Fabric:
    """Parse Slurm topology.conf block syntax (`BlockName=b1 Nodes=node[01-18]`, optional `BlockSizes=18,36,72`).

    Tiers are `block`, then one aggregate tier per BlockSizes entry beyond the first (the base block size):
    `block2`, `block3`, ... An aggregate of size S groups S / base consecutive blocks, in file order, into domains
    named `agg<level>-<index>` (level 2 for `block2`, index from 0); a trailing group may hold fewer blocks.
    """
    blocks: list[tuple[str, list[str]]] = []
    block_of: dict[str, str] = {}
    sizes: list[int] = []
    sizes_line = 0
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = dict(_key_values(line, lineno))
        if "switchname" in fields:
            raise FabricError(f"line {lineno}: SwitchName= mixed with block topology (BlockName=); use one syntax")
        if "blocksizes" in fields:
            if sizes_line:
                raise FabricError(f"line {lineno}: BlockSizes= given twice (first on line {sizes_line})")
            if set(fields) != {"blocksizes"}:
                raise FabricError(f"line {lineno}: BlockSizes= must be on a line of its own")
            sizes_line = lineno
            try:
                sizes = [int(v) for v in fields["blocksizes"].split(",")]
            except ValueError:
                raise FabricError(
                    f"line {lineno}: BlockSizes must be comma-separated node counts, got {fields['blocksizes']!r}"
                ) from None
            if not sizes or any(v < 1 for v in sizes):
                raise FabricError(f"line {lineno}: BlockSizes must be positive node counts")
            base = sizes[0]
            for v in sizes[1:]:
                if v % base:
                    raise FabricError(f"line {lineno}: BlockSizes entry {v} is not a multiple of the base size {base}")
            if any(b <= a for a, b in zip(sizes, sizes[1:], strict=False)):
                raise FabricError(f"line {lineno}: BlockSizes must increase, largest last")
            continue
        name = fields.get("blockname")
        if not name:
            raise FabricError(f"line {lineno}: expected BlockName=... or BlockSizes=..., got {raw.strip()!r}")
        if any(b == name for b, _ in blocks):
            raise FabricError(f"line {lineno}: block {name!r} is defined twice")
        if "nodes" not in fields:
            raise FabricError(f"line {lineno}: block {name!r} lists no Nodes=")
        try:
            members = expand_hostlist(fields["nodes"])
        except ValueError as exc:
            raise FabricError(f"line {lineno}: {exc}") from exc
        if not members:
            raise FabricError(f"line {lineno}: block {name!r} lists no nodes")
        for node in members:
            if node in block_of:
                raise FabricError(f"line {lineno}: node {node!r} is in two blocks ({block_of[node]!r} and {name!r})")
            block_of[node] = name
        blocks.append((name, members))

    groups = [size // sizes[0] for size in sizes[1:]] if sizes else []
    paths: dict[str, tuple[str, ...]] = {}
    for index, (name, members) in enumerate(blocks):
        path = (name, *(f"agg{level}-{index // per}" for level, per in enumerate(groups, 2)))
        for node in members:
            paths[node] = path
    tiers = ("block", *(f"block{level}" for level in range(2, len(groups) + 2))) if blocks else ()
    return Fabric(tiers=tiers, paths=paths)


def parse_slurm(text: str) -> Fabric:
    """Parse a Slurm topology.conf in either syntax: block when any line sets BlockName=, else tree."""
    if _is_block_syntax(text):
        return parse_slurm_block(text)
    return parse_slurm_tree(text)


_BLOCK_KEY = re.compile(r"(?:^|\s)(?:blockname|blocksizes)=", re.IGNORECASE)


def _is_block_syntax(text: str) -> bool:
    return any(_BLOCK_KEY.search(raw.split("#", 1)[0]) for raw in text.splitlines())


def _key_values(line: str, lineno: int) -> Iterable[tuple[str, str]]:
    for token in re.split(r"\s+", line):
        if "=" not in token:
            raise FabricError(f"line {lineno}: expected Key=Value, got {token!r}")
        key, value = token.split("=", 1)
        yield key.lower(), value


def parse_fabric_yaml(text: str) -> Fabric:
    """Phalanx fabric YAML.

    ```yaml
    tiers: [leaf, spine]
    switches:               # a tree, from the top
      spine0:
        leaf0: [dgx[01-04]]
        leaf1: [dgx[05-08]]
    ```
    or the flat form `nodes: {dgx01: [leaf0, spine0], ...}` that `Fabric.to_yaml` writes.
    """
    try:
        doc = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise FabricError(f"invalid YAML: {exc}") from exc
    if not isinstance(doc, dict):
        raise FabricError("fabric YAML must be a mapping with `tiers` and `switches` or `nodes`")
    tiers = tuple(str(t) for t in doc.get("tiers", ()))
    paths: dict[str, tuple[str, ...]] = {}
    if "nodes" in doc:
        for node, path in (doc["nodes"] or {}).items():
            paths[str(node)] = tuple(str(s) for s in path)
    if "switches" in doc:
        _walk_switches(doc["switches"], (), paths)
    depth = max((len(p) for p in paths.values()), default=0)
    if not tiers:
        tiers = tuple(tree_tier_name(i) for i in range(depth))
    if len(tiers) < depth:
        raise FabricError(f"fabric names {len(tiers)} tiers but its tree is {depth} switches deep")
    for node, path in paths.items():
        if len(path) != depth:
            raise FabricError(f"node {node!r} sits {len(path)} switches deep, others {depth}")
    return Fabric(tiers=tiers, paths=paths)


def _walk_switches(tree, above: tuple[str, ...], paths: dict[str, tuple[str, ...]]) -> None:
    if isinstance(tree, dict):
        for switch, below in tree.items():
            _walk_switches(below, (str(switch), *above), paths)
    elif isinstance(tree, list | str):
        items = [tree] if isinstance(tree, str) else tree
        for item in items:
            for node in expand_hostlist(str(item)):
                if node in paths:
                    raise FabricError(f"node {node!r} appears twice in the fabric")
                paths[node] = above
    else:
        raise FabricError(f"unexpected {type(tree).__name__} in fabric switches")


def load_fabric(path: str | Path) -> Fabric:
    """Read a fabric file: `.yaml`/`.yml` as Phalanx YAML, anything else as Slurm topology.conf (tree or block)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise FabricError(f"cannot read fabric file {p}: {exc.strerror}") from exc
    if p.suffix in (".yaml", ".yml"):
        return parse_fabric_yaml(text)
    return parse_slurm(text)


def default_fabric(nodes: Iterable[str], nodes_per_leaf: int = 4, leaves_per_spine: int = 8) -> Fabric:
    """A two-tier fat-tree for nodes given in order: `nodes_per_leaf` nodes per leaf, leaves under spines."""
    names = list(nodes)
    paths = {}
    for i, node in enumerate(names):
        leaf = i // nodes_per_leaf
        paths[node] = (f"leaf{leaf}", f"spine{leaf // leaves_per_spine}")
    return Fabric(tiers=("leaf", "spine"), paths=paths)


def to_slurm_tree(fabric: Fabric) -> str:
    """Write the fabric as Slurm tree syntax (one line per switch), for Slurm users and for tests."""
    lines = []
    leaves: dict[str, list[str]] = {}
    parents: dict[str, set[str]] = {}
    for node, path in sorted(fabric.paths.items()):
        if not path:
            continue
        leaves.setdefault(path[0], []).append(node)
        for lower, upper in zip(path, path[1:], strict=False):
            if lower != upper:
                parents.setdefault(upper, set()).add(lower)
    for leaf, members in sorted(leaves.items()):
        lines.append(f"SwitchName={leaf} Nodes={','.join(members)}")
    for upper, kids in sorted(parents.items()):
        lines.append(f"SwitchName={upper} Switches={','.join(sorted(kids))}")
    return "\n".join(lines) + "\n"

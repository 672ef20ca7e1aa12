"""The inter-node fabric: which switch of each tier every node sits under.

A fabric is static structure: tier names from the lowest switch tier up (for a Slurm tree: `leaf`, `spine`, `core`,
then `tier3`, `tier4`, ...; for Slurm block syntax: `block`, `block2`, ...) and, per node, its switches from the leaf
up. Read it from a Slurm `topology.conf` in tree or block syntax or from Phalanx's own YAML; nodes the fabric does not
name sit directly under the cluster root.

NVLink domains (Phalanx YAML `nvlink_domains:`) add a tier below the leaf: the tiers become ("nvlink", leaf, ...) and
each node's path (domain, leaf, ...). A domain is a node's own NVSwitch (keyed by the node's name) or a multi-node
domain such as a GB200 NVL72 rack (18 trays of 4 GPUs), declared in the YAML or reported by the agents through
NVML's fabric cluster UUID and clique (`Fabric.node_path`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .hostlist import compress_hostlist, expand_hostlist

TREE_TIER_NAMES = ("leaf", "spine", "core")
NVLINK_TIER = "nvlink"
AUTO = "auto"


def tree_tier_name(level: int) -> str:
    """Name of switch level `level` (0 = switches that list Nodes=) in a Slurm tree file."""
    return TREE_TIER_NAMES[level] if level < len(TREE_TIER_NAMES) else f"tier{level}"


@dataclass(frozen=True)
class Fabric:
    """Tier names, lowest first, and each node's path: its domain of each tier, `path[i]` being of `tiers[i]`.

    `nvlink_domains` is None for a plain fabric. Otherwise the fabric has the NVLink tier: `tiers[0]` is "nvlink",
    every path starts with the node's NVLink domain, and `nvlink_domains` maps each node of a declared multi-node
    domain to that domain ({} for `nvlink_domains: auto`: every domain comes from the agents, see `node_path`).
    """

    tiers: tuple[str, ...] = ()
    paths: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    nvlink_domains: Mapping[str, str] | None = None
    # Rail-optimized (DGX SuperPOD style) when > 0: each leaf domain is a scalable unit of `rails` rail switches,
    # NIC i of every node (GPU i's) on rail i; traffic between different rails goes up to the spine tier even
    # inside one unit. 0: classic top-of-rack trees, every NIC of a node on its one leaf switch.
    rails: int = 0

    @property
    def has_nvlink(self) -> bool:
        return self.nvlink_domains is not None

    @property
    def switch_tiers(self) -> tuple[str, ...]:
        """The switch tiers (leaf and up), without the NVLink tier."""
        return self.tiers[1:] if self.has_nvlink else self.tiers

    def path(self, node: str) -> tuple[str, ...]:
        """The node's static path (with the NVLink tier: its declared domain, else its own name, first)."""
        return tuple(self.paths.get(node, ()))

    def switch_path(self, node: str) -> tuple[str, ...]:
        """The node's switches from the leaf up (its path without the NVLink domain)."""
        path = self.path(node)
        return path[1:] if self.has_nvlink else path

    def node_path(self, name: str, cluster_uuid: str = "", clique: str = "") -> tuple[str, ...]:
        """The path of a node that registers with this NVML fabric cluster UUID and clique (both "" when none).

        Plain fabrics: `path(name)`. With the NVLink tier: (domain, *switch path), the domain being the node's
        declared one, else the agent's fabric clique (`nvlink_domain_key`), else the node's own name (its NVSwitch).
        """
        if self.nvlink_domains is None:
            return self.path(name)
        domain = self.nvlink_domains.get(name) or nvlink_domain_key(cluster_uuid, clique) or name
        return (domain, *self.switch_path(name))

    def to_yaml(self) -> str:
        rails = {"rails": self.rails} if self.rails else {}
        out: str  # yaml.safe_dump without a stream returns the document as a str (PyYAML has no stubs here)
        if self.nvlink_domains is None:
            out = yaml.safe_dump(
                {"tiers": list(self.tiers), **rails, "nodes": {n: list(p) for n, p in self.paths.items()}}
            )
            return out
        members: dict[str, list[str]] = {}
        for node, domain in self.nvlink_domains.items():
            members.setdefault(domain, []).append(node)
        out = yaml.safe_dump(
            {
                "tiers": list(self.switch_tiers),
                **rails,
                "nvlink_domains": {d: sorted(ns) for d, ns in sorted(members.items())} or AUTO,
                "nodes": {n: list(self.switch_path(n)) for n in self.paths},
            }
        )
        return out


def nvlink_domain_key(cluster_uuid: str, clique: str = "") -> str:
    """The NVLink domain of an agent's NVML fabric info: `nvl-<first 8 hex digits of the cluster UUID>-<clique>`
    (`nvl-<8 hex>` without a clique); "" when the node reports no fabric cluster (no multi-node NVLink)."""
    hexed = cluster_uuid.replace("-", "").strip().lower()
    if not hexed.strip("0"):
        return ""
    return f"nvl-{hexed[:8]}-{clique}" if clique != "" else f"nvl-{hexed[:8]}"


def with_nvlink_domains(fabric: Fabric, declared: Mapping[str, str] | None = None) -> Fabric:
    """`fabric` (a plain one) with the NVLink tier: `declared` maps nodes to multi-node domains ({} or None: auto).

    Every member of a domain must sit under the same switches; a member the fabric does not name gets the switch
    path of the others (none when the fabric has no switches). A node outside every declared domain is its own
    domain, keyed by its name (so a domain may not be named after a node outside it).
    """
    if fabric.has_nvlink:
        raise FabricError("the fabric already has an NVLink tier")
    if NVLINK_TIER in fabric.tiers:
        raise FabricError(f"tier name {NVLINK_TIER!r} is reserved for NVLink domains (`nvlink_domains:`)")
    declared = dict(declared or {})
    depth = max((len(p) for p in fabric.paths.values()), default=0)
    by_domain: dict[str, list[str]] = {}
    for node, domain in declared.items():
        by_domain.setdefault(domain, []).append(node)
    paths = {node: (declared.get(node, node), *path) for node, path in fabric.paths.items()}
    for domain, members in by_domain.items():
        if domain in fabric.paths and domain not in members:
            raise FabricError(f"NVLink domain {domain!r} has the name of node {domain!r}, which is not in it")
        placed = {m: fabric.paths[m] for m in members if m in fabric.paths}
        where = set(placed.values())
        if len(where) > 1:
            (a, pa), (b, pb) = _two_differing(placed)
            raise FabricError(
                f"NVLink domain {domain!r} spans two leaves: {a} is under {'/'.join(pa) or 'the root'}, "
                f"{b} under {'/'.join(pb) or 'the root'}; all nodes of a domain must sit under the same leaf"
            )
        if not where and depth:
            raise FabricError(
                f"NVLink domain {domain!r} lists node {sorted(members)[0]!r}, which the fabric's switches do not name"
            )
        switches = next(iter(where)) if where else ()
        for node in members:
            paths[node] = (domain, *switches)
    return Fabric(tiers=(NVLINK_TIER, *fabric.tiers), paths=paths, nvlink_domains=declared, rails=fabric.rails)


def _two_differing(
    placed: Mapping[str, tuple[str, ...]],
) -> tuple[tuple[str, tuple[str, ...]], tuple[str, tuple[str, ...]]]:
    items = sorted(placed.items())
    first = items[0]
    return first, next(item for item in items if item[1] != first[1])


def group_nvlink_domains(fabric: Fabric, nodes_per_domain: int, prefix: str = "nvl") -> Fabric:
    """Simulated multi-node NVLink domains (what agents of e.g. `gb200-nvl72` would report): the nodes in no declared
    domain, taken per switch path in name order, form domains of `nodes_per_domain` consecutive nodes named
    `<prefix>-0`, `<prefix>-1`, ... (names already in use are skipped). Declared domains win. The fabric gets the
    NVLink tier if it has none."""
    if nodes_per_domain < 1:
        raise ValueError("nodes_per_domain must be at least 1")
    base = fabric if fabric.has_nvlink else with_nvlink_domains(fabric, {})
    declared = dict(base.nvlink_domains or {})
    taken = set(declared.values()) | set(base.paths)
    by_switches: dict[tuple[str, ...], list[str]] = {}
    for node in sorted(base.paths):
        if node not in declared:
            by_switches.setdefault(base.switch_path(node), []).append(node)
    index = 0
    for _, nodes in sorted(by_switches.items()):
        for start in range(0, len(nodes), nodes_per_domain):
            while f"{prefix}-{index}" in taken:
                index += 1
            for node in nodes[start : start + nodes_per_domain]:
                declared[node] = f"{prefix}-{index}"
            index += 1
    plain = Fabric(tiers=base.switch_tiers, paths={n: base.switch_path(n) for n in base.paths}, rails=base.rails)
    return with_nvlink_domains(plain, declared)


class FabricError(ValueError):
    """A fabric description that cannot be read; the message says where."""


def parse_slurm_tree(text: str) -> Fabric:
    """Parse Slurm topology.conf tree syntax (`SwitchName=s0 Nodes=dgx[01-04]`, `SwitchName=s1 Switches=s[0-1]`).

    A file in block syntax (any BlockName= or BlockSizes=) is read as such (`parse_slurm_block`)."""
    if _is_block_syntax(text):
        return parse_slurm_block(text)
    nodes_of: dict[str, list[str]] = {}
    children_of: dict[str, list[str]] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = dict(_key_values(line, lineno))
        name = fields.get("switchname")
        if not name:
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

    `rails: 8` makes it rail-optimized: every leaf is a scalable unit of 8 rail switches, GPU/NIC i of each node on
    rail i (see `Fabric.rails` and core.cost). Without it, leaves are classic top-of-rack switches.

    NVLink domains add the `nvlink` tier below the leaf (do not list it in `tiers`):
    ```yaml
    nvlink_domains:         # multi-node domains (GB200 NVL72 racks), hostlists or lists of them
      nvl0: "gb[001-018]"
      nvl1: ["gb[019-036]"]
    ```
    A node in no declared domain is its own domain (its NVSwitch), unless its agent reports an NVML fabric clique
    (`Fabric.node_path`). `nvlink_domains: auto` declares none: the tier exists, the agents' cliques say who shares
    a domain. All nodes of one domain must sit under the same leaf.
    """
    try:
        doc = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise FabricError(f"invalid YAML: {exc}") from exc
    if not isinstance(doc, dict):
        raise FabricError("fabric YAML must be a mapping with `tiers` and `switches` or `nodes`")
    tiers = tuple(str(t) for t in doc.get("tiers") or ())
    declared = _nvlink_section(doc["nvlink_domains"]) if "nvlink_domains" in doc else None
    if declared is not None and tiers[:1] == (NVLINK_TIER,):
        tiers = tiers[1:]  # tolerated: the tier is implied by nvlink_domains
    if NVLINK_TIER in tiers:
        raise FabricError(
            f"tier {NVLINK_TIER!r} comes from `nvlink_domains:` (a mapping of domains to hostlists, or `auto`) "
            "and is always the lowest; leave it out of `tiers`"
            if declared is not None
            else f"tier {NVLINK_TIER!r} needs `nvlink_domains:` (a mapping of domains to hostlists, or `auto`)"
        )
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
    rails = doc.get("rails", 0) or 0
    if isinstance(rails, bool) or not isinstance(rails, int) or rails < 0:
        raise FabricError(f"rails must be a non-negative number of rail switches per leaf, got {rails!r}")
    fabric = Fabric(tiers=tiers, paths=paths, rails=rails)
    return fabric if declared is None else with_nvlink_domains(fabric, declared)


def _nvlink_section(section: object) -> dict[str, str]:
    """`nvlink_domains:` of the YAML: `auto` (or an empty mapping) -> {}, else node -> domain."""
    if isinstance(section, str) and section.strip().lower() == AUTO:
        return {}
    if section is None:
        section = {}
    if not isinstance(section, dict):
        raise FabricError(f"nvlink_domains must be `auto` or a mapping of domain names to hostlists, got {section!r}")
    declared: dict[str, str] = {}
    for domain, members in section.items():
        domain = str(domain)
        if not domain:
            raise FabricError("nvlink_domains: a domain has an empty name")
        items = [members] if isinstance(members, str) else members
        if not isinstance(items, list) or not items:
            raise FabricError(f"nvlink domain {domain!r} must list its nodes (a hostlist or a list of them)")
        for item in items:
            try:
                names = expand_hostlist(str(item))
            except ValueError as exc:
                raise FabricError(f"nvlink domain {domain!r}: {exc}") from exc
            for node in names:
                if node in declared and declared[node] != domain:
                    raise FabricError(f"node {node!r} is in two NVLink domains ({declared[node]!r} and {domain!r})")
                if node in declared:
                    raise FabricError(f"node {node!r} is listed twice in NVLink domain {domain!r}")
                declared[node] = domain
    return declared


def _walk_switches(tree: object, above: tuple[str, ...], paths: dict[str, tuple[str, ...]]) -> None:
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


def default_fabric(nodes: Iterable[str], nodes_per_leaf: int = 4, leaves_per_spine: int = 8, rails: int = 0) -> Fabric:
    """A two-tier fat-tree for nodes given in order: `nodes_per_leaf` nodes per leaf, leaves under spines
    (`rails` > 0: each leaf a rail-optimized scalable unit of that many rails)."""
    names = list(nodes)
    paths = {}
    for i, node in enumerate(names):
        leaf = i // nodes_per_leaf
        paths[node] = (f"leaf{leaf}", f"spine{leaf // leaves_per_spine}")
    return Fabric(tiers=("leaf", "spine"), paths=paths, rails=rails)


def to_slurm_tree(fabric: Fabric) -> str:
    """Write the fabric as Slurm tree syntax (one line per switch), for Slurm users and for tests.

    Slurm has no NVLink tier: NVLink domains are left out (the switches from the leaf up are written)."""
    lines = []
    leaves: dict[str, list[str]] = {}
    parents: dict[str, set[str]] = {}
    for node in sorted(fabric.paths):
        path = fabric.switch_path(node)
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


def to_slurm_block(fabric: Fabric) -> str:
    """Write the fabric as Slurm block syntax (`BlockName=` per block, then `BlockSizes=`), what `parse_slurm_block`
    reads back to the same blocks and aggregates.

    The blocks are the lowest tier's domains: the NVLink domains where the fabric has them (GB200 NVL72 racks, the
    case Slurm's block topology is for), else the leaves. Blocks are written in switch order, so consecutive blocks
    share their higher switches. BlockSizes is the largest block's node count, then one aggregate size per higher
    tier while that tier groups the same number of consecutive blocks in every domain (Slurm aggregates are uniform;
    the first tier that is not, and every tier above it, are left out; the trailing domain may be short). Nodes in no
    block are left out. Raises FabricError for a fabric without tiers."""
    if not fabric.tiers:
        raise FabricError("the fabric has no tiers: there are no blocks to write")
    blocks: dict[str, list[str]] = {}
    above: dict[str, tuple[str, ...]] = {}
    for node in sorted(fabric.paths, key=lambda n: (fabric.path(n)[::-1], n)):
        path = fabric.path(node)
        if not path or not path[0]:
            continue
        blocks.setdefault(path[0], []).append(node)
        above.setdefault(path[0], path[1:])
    lines = [f"BlockName={name} Nodes={compress_hostlist(members)}" for name, members in blocks.items()]
    sizes = [max(len(m) for m in blocks.values())]
    order = list(blocks)
    for level in range(len(fabric.tiers) - 1):
        runs: list[int] = []
        for i, name in enumerate(order):
            domain = above[name][level] if level < len(above[name]) else ""
            prev = above[order[i - 1]][level] if i and level < len(above[order[i - 1]]) else None
            if i and domain == prev:
                runs[-1] += 1
            else:
                runs.append(1)
        per = runs[0]  # blocks per domain of this tier: the parser groups that many consecutive blocks
        if any(r != per for r in runs[:-1]) or runs[-1] > per or sizes[0] * per <= sizes[-1]:
            break
        sizes.append(sizes[0] * per)
    if len(sizes) > 1:
        lines.append("BlockSizes=" + ",".join(str(v) for v in sizes))
    return "\n".join(lines) + "\n"

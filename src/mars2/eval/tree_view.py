"""Trees you can look at: a self-contained HTML page per tree and a PNG overview of training."""

from __future__ import annotations

import html
import json
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from mars2.sandbox.base import Verdict
from mars2.search.tree import SearchTree
from mars2.utils.atomic import atomic_open, atomic_write_text

_PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#ff9da7", "#9c755f"]


def _layout(tree: SearchTree) -> dict[int, tuple[float, int]]:
    """x (leaf order, parents centred over children) and depth for every node."""
    positions: dict[int, tuple[float, int]] = {}
    next_leaf = [0.0]

    def place(node_id: int) -> float:
        node = tree.nodes[node_id]
        if not node.children:
            x = next_leaf[0]
            next_leaf[0] += 1
        else:
            xs = [place(c) for c in node.children]
            x = sum(xs) / len(xs)
        positions[node_id] = (x, node.depth)
        return x

    place(0)
    return positions


def _colour(reward: float) -> str:
    """Red (0) to green (1)."""
    r = max(0.0, min(1.0, reward))
    return f"rgb({int(220 * (1 - r)) + 20},{int(180 * r) + 40},70)"


def best_node(tree: SearchTree) -> int:
    """The node a page opens on: the answer the tree submits (best public pass rate, latest on
    ties), else the highest reward, else the problem itself."""
    best = None
    for node in tree.answers():
        key = (node.public_pass_rate, node.reward, node.id)
        if best is None or key >= best[0]:
            best = (key, node.id)
    return best[1] if best is not None else 0


def render_tree_html(tree: SearchTree, title: str | None = None) -> str:
    """One page, no external assets: an SVG of the tree that scales to the left half of the
    window (many children never push it off screen), opened on the best node; clicking a node
    shows its details (prompt, code, failing public tests)."""
    positions = _layout(tree)
    agents = sorted({n.agent for n in tree.answers() if n.agent})
    agent_colour = {a: _PALETTE[i % len(_PALETTE)] for i, a in enumerate(agents)}
    width = max(1.0, max(x for x, _ in positions.values()) + 1)
    depth = max(d for _, d in positions.values()) + 1
    sx, sy, pad = 56, 80, 40
    svg_w, svg_h = int(max(width * sx + 2 * pad, 240)), int(depth * sy + 2 * pad)
    best = best_node(tree)

    def xy(node_id: int) -> tuple[float, float]:
        x, d = positions[node_id]
        return pad + x * sx + sx / 2, pad + d * sy

    parts = []
    for node in tree.answers():
        assert node.parent is not None
        (x1, y1), (x2, y2) = xy(node.parent), xy(node.id)
        parts.append(
            f'<line x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" stroke="#999" stroke-width="2"/>'
        )
    for node in tree.nodes:
        x, y = xy(node.id)
        if node.is_root:
            parts.append(f'<g class="node" data-id="0"><rect x="{x - 30}" y="{y - 16}" width="60" height="32" rx="6" fill="#333"/>'
                         f'<text x="{x}" y="{y + 5}" fill="#fff" text-anchor="middle">problem</text></g>')  # fmt: skip
            continue
        ring = agent_colour.get(node.agent or "", "#000")
        label = html.escape(f"#{node.id}")
        mark = (f'<circle cx="{x}" cy="{y}" r="25" fill="none" stroke="#111" stroke-width="2" '
                'stroke-dasharray="4 3"/>' if node.id == best else "")  # fmt: skip
        parts.append(
            f'<g class="node" data-id="{node.id}"><title>#{node.id} {html.escape(str(node.agent))}</title>{mark}'
            f'<circle cx="{x}" cy="{y}" r="19" fill="{_colour(node.reward)}" stroke="{ring}" stroke-width="5"/>'
            f'<text x="{x}" y="{y + 4}" text-anchor="middle" fill="#fff" font-size="11">{node.reward:.2f}</text>'
            f'<text x="{x}" y="{y + 35}" text-anchor="middle" font-size="10">{label}</text></g>'
        )
    legend = " ".join(
        f'<span style="border-bottom:4px solid {c};margin-right:12px">{html.escape(a)}</span>'
        for a, c in agent_colour.items()
    )
    details = {
        str(n.id): {
            "agent": n.agent,
            "depth": n.depth,
            "reward": n.reward,
            "private_passed": n.private_passed,
            "prompt": "\n\n".join(f"[{m['role']}]\n{m['content']}" for m in n.messages),
            "code": n.code or "(no code block)",
            "failing": [
                {**asdict(f), "verdict": f.verdict.value}
                for f in n.grade.public
                if f.verdict is not Verdict.PASSED
            ],
        }
        for n in tree.answers()
    }
    details["0"] = {
        "agent": None,
        "depth": 0,
        "reward": None,
        "prompt": tree.problem.statement,
        "code": "",
        "failing": [],
    }
    page_title = html.escape(title or f"Tree for {tree.problem.id}")
    data = json.dumps(details).replace("</", "<\\/")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{page_title}</title>
<style>
body{{font-family:sans-serif;margin:0;display:flex;height:100vh}}
#tree{{flex:1;min-width:0;overflow:auto;padding:8px}} #panel{{width:42%;overflow:auto;padding:12px;background:#f6f6f6;border-left:1px solid #ccc}}
.node{{cursor:pointer}} pre{{white-space:pre-wrap;background:#fff;padding:8px;border:1px solid #ddd}}
</style></head><body>
<div id="tree"><h2>{page_title}</h2><p>{len(tree)} answers, solved: {tree.solved}. Fill: reward (red 0 → green 1); ring: agent; dashed: the best answer (shown on the right). {legend}</p>
<svg viewBox="0 0 {svg_w} {svg_h}" width="100%" style="max-width:{svg_w}px;height:auto" xmlns="http://www.w3.org/2000/svg">{"".join(parts)}</svg></div>
<div id="panel"><p>Click a node to see its prompt, code and failing tests.</p></div>
<script>
const nodes = {data};
function esc(s) {{ return String(s).replace(/[&<>]/g, c => ({{"&":"&amp;","<":"&lt;",">":"&gt;"}})[c]); }}
function show(id) {{
  const n = nodes[id];
  let h = `<h3>Node #${{id}}${{n.agent ? " by " + esc(n.agent) : ""}}</h3><p>depth ${{n.depth}}, reward ${{n.reward}}</p>`;
  h += `<h4>Prompt</h4><pre>${{esc(n.prompt)}}</pre><h4>Code</h4><pre>${{esc(n.code)}}</pre>`;
  if (n.failing.length) h += "<h4>Failing public tests</h4>" + n.failing.map(f =>
      `<pre>[${{esc(f.verdict)}}]\\ninput: ${{esc(f.input)}}\\nexpected: ${{esc(f.expected)}}\\ngot: ${{esc(f.actual)}}\\n${{esc(f.error||"")}}</pre>`).join("");
  document.getElementById("panel").innerHTML = h;
}}
document.querySelectorAll(".node").forEach(g => g.addEventListener("click", () => show(g.dataset.id)));
show("{best}");
</script></body></html>
"""


def write_tree_pages(trees: Sequence[SearchTree], directory: str | Path) -> list[Path]:
    """One HTML page per tree; returns their paths."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for index, tree in enumerate(trees):
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in tree.problem.id)
        path = out / f"{index:04d}_{safe}.html"
        atomic_write_text(path, render_tree_html(tree))
        paths.append(path)
    return paths


def overview_figure(trees_by_step: Mapping[int, Sequence[SearchTree]]) -> Any:
    """The overview's matplotlib figure: per-agent share of expansions and mean reward over
    training steps, steps on whole-number ticks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps = sorted(trees_by_step)
    share: dict[str, list[float]] = defaultdict(list)
    reward: dict[str, list[float]] = defaultdict(list)
    agents = sorted(
        {n.agent for ts in trees_by_step.values() for t in ts for n in t.answers() if n.agent}
    )
    for step in steps:
        nodes = [n for t in trees_by_step[step] for n in t.answers()]
        for agent in agents:
            mine = [n.reward for n in nodes if n.agent == agent]
            share[agent].append(len(mine) / max(1, len(nodes)))
            reward[agent].append(sum(mine) / len(mine) if mine else float("nan"))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for agent in agents:
        left.plot(steps, share[agent], marker="o", label=agent)
        right.plot(steps, reward[agent], marker="o", label=agent)
    left.set(title="share of expansions", xlabel="step", ylim=(0, 1))
    right.set(title="mean reward of its nodes", xlabel="step", ylim=(-0.05, 1.05))
    for axis in (left, right):
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    left.legend()
    fig.tight_layout()
    return fig


def plot_training_overview(
    trees_by_step: Mapping[int, Sequence[SearchTree]], path: str | Path
) -> Path:
    """PNG of `overview_figure`."""
    import matplotlib.pyplot as plt

    fig = overview_figure(trees_by_step)
    out = Path(path)
    with atomic_open(out, "wb") as handle:
        fig.savefig(handle, dpi=100, format="png")
    plt.close(fig)
    return out

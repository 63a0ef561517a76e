"""Pure functions over draft trees: candidates to trie, trie to attention mask and positions.

A draft tree hangs below the *root* (the last committed token, not yet in the KV cache).
The target verifies root and nodes in one forward pass of N + 1 tokens: row 0 is the
root, row ``i + 1`` is node ``i``. Each row attends to the whole cache and to its own
ancestors (Miao et al. 2024, SpecInfer, section 4 "tree attention").
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .types import DraftTree

__all__ = [
    "tree_from_candidates",
    "draft_from_candidates",
    "tree_attention_mask",
    "tree_position_ids",
    "path_to_node",
    "follow_path",
    "merge_trees",
    "drop_invalid_nodes",
    "interleaved_tree",
    "select_nodes",
]


def draft_from_candidates(
    candidates: Sequence[Sequence[int]], *, max_nodes: int, source: str = "draft", match_len: int = 0
) -> DraftTree:
    """A lookup's continuations as a draft: none -> the empty tree, one -> a chain, more ->
    :func:`tree_from_candidates` (the n-gram drafters' common last step)."""
    if not candidates:
        return DraftTree.empty()
    if len(candidates) == 1:
        return DraftTree.chain(candidates[0], source=source, match_len=match_len)
    return tree_from_candidates(candidates, max_nodes=max_nodes, source=source, match_len=match_len)


def tree_from_candidates(
    candidates: Sequence[Sequence[int]],
    *,
    counts: Optional[Sequence[float]] = None,
    max_nodes: int,
    source: str = "draft",
    match_len: int = 0,
) -> DraftTree:
    """Merge token sequences into a prefix trie and keep the ``max_nodes`` best nodes.

    Each trie node's weight is the summed ``counts`` of the candidates passing through it
    (1 each when ``counts`` is None). Nodes are kept best-first by weight, ties broken by
    (depth, first-seen order), and only when their parent is kept, so the result is always
    a valid tree (REST, He et al. 2024, section 3.2, "draft construction").

    Example: candidates [[5, 6, 7], [5, 6, 8], [9]] with max_nodes=4 keeps 5, 6 (weight 2)
    and 7, 9 (weight 1; 7 and 8 tie, 7 was seen first, 9 wins on depth); in topological
    order: tokens [5, 9, 6, 7], parents [-1, -1, 0, 2].

    Args:
        candidates: continuations (token ids), each starting right after the root.
        counts: weight per candidate (e.g. its frequency in the datastore).
        max_nodes: most nodes in the result.
        source: tag written to every node.
        match_len: suffix-match length recorded on the tree.

    Returns:
        A DraftTree in topological order; ``scores`` holds each node's weight divided by
        its parent's weight (the empirical chance of that branch).
    """
    # trie: key (parent_trie_id, token) -> trie id
    children: dict[tuple[int, int], int] = {}
    tok: list[int] = []
    par: list[int] = []
    dep: list[int] = []
    weight: list[float] = []
    for ci, cand in enumerate(candidates):
        w = 1.0 if counts is None else float(counts[ci])
        parent = -1
        for d, t in enumerate(cand):
            key = (parent, int(t))
            node = children.get(key)
            if node is None:
                node = len(tok)
                children[key] = node
                tok.append(int(t))
                par.append(parent)
                dep.append(d)
                weight.append(0.0)
            weight[node] += w
            parent = node
    if not tok or max_nodes <= 0:
        return DraftTree.empty()
    # best-first selection that keeps parents before children
    order = sorted(range(len(tok)), key=lambda i: (-weight[i], dep[i], i))
    kept: set[int] = set()
    chosen: list[int] = []
    # a node can only be chosen once its parent is chosen: iterate until full or stuck
    pending = list(order)
    while pending and len(chosen) < max_nodes:
        progressed = False
        rest = []
        for i in pending:
            if len(chosen) >= max_nodes:
                break
            if par[i] == -1 or par[i] in kept:
                kept.add(i)
                chosen.append(i)
                progressed = True
            else:
                rest.append(i)
        if not progressed:
            break
        pending = [i for i in rest if i not in kept]
    # topological order: by depth, then by selection rank
    rank = {n: r for r, n in enumerate(chosen)}
    chosen.sort(key=lambda i: (dep[i], rank[i]))
    new_index = {old: new for new, old in enumerate(chosen)}
    tokens = torch.tensor([tok[i] for i in chosen], dtype=torch.long)
    parents = torch.tensor([new_index[par[i]] if par[i] != -1 else -1 for i in chosen], dtype=torch.long)
    depth = torch.tensor([dep[i] for i in chosen], dtype=torch.long)
    total = sum(weight[i] for i in chosen if par[i] == -1) or 1.0
    scores = torch.tensor(
        [weight[i] / (weight[par[i]] if par[i] != -1 else total) for i in chosen], dtype=torch.float32
    )
    return DraftTree(tokens, parents, depth, (source,) * len(chosen), scores, None, match_len)


def merge_trees(trees: Sequence[DraftTree], max_nodes: int) -> DraftTree:
    """Merge several trees into one trie (shared prefixes become one node), keeping the
    nodes of earlier trees first. Scores, sources and match lengths of the first tree
    holding a node win; each node keeps its own tree's match length (``node_match_len``).
    Draft probabilities are dropped (a merged tree is verified as deterministic)."""
    tok: list[int] = []
    par: list[int] = []
    dep: list[int] = []
    src: list[str] = []
    sc: list[float] = []
    ml: list[int] = []
    index: dict[tuple[int, int], int] = {}
    match_len = 0
    for tree in trees:
        if tree.num_nodes == 0:
            continue
        match_len = max(match_len, tree.match_len)
        mapping: dict[int, Optional[int]] = {}
        scores = tree.scores.tolist() if tree.scores is not None else [1.0] * tree.num_nodes
        lens = tree.match_lens()
        for i, (t, p) in enumerate(zip(tree.tokens.tolist(), tree.parents.tolist())):
            new_parent = mapping[p] if p != -1 else -1
            if new_parent is None:
                mapping[i] = None  # parent was dropped
                continue
            key = (new_parent, t)
            if key in index:
                mapping[i] = index[key]
                continue
            if len(tok) >= max_nodes:
                mapping[i] = None
                continue
            index[key] = len(tok)
            mapping[i] = len(tok)
            tok.append(t)
            par.append(new_parent)
            dep.append(0 if new_parent == -1 else dep[new_parent] + 1)
            src.append(tree.sources[i] if i < len(tree.sources) else "draft")
            sc.append(scores[i])
            ml.append(lens[i])
    if not tok:
        return DraftTree.empty()
    # nodes are appended after their parents, so the order is topological already
    return DraftTree(
        torch.tensor(tok, dtype=torch.long),
        torch.tensor(par, dtype=torch.long),
        torch.tensor(dep, dtype=torch.long),
        tuple(src),
        torch.tensor(sc, dtype=torch.float32),
        None,
        match_len,
        None if all(m == match_len for m in ml) else torch.tensor(ml, dtype=torch.long),
    )


def tree_attention_mask(tree: DraftTree, past_len: int, device: Optional[torch.device] = None) -> torch.Tensor:
    """Boolean attention mask of the verification forward pass.

    Args:
        tree: the draft tree (N nodes).
        past_len: tokens already in the KV cache (the root is *not* among them).

    Returns:
        bool [1, 1, N + 1, past_len + N + 1]: True where row (root or node) may attend.
        Every row sees the whole cache, the root, and its own ancestors and itself.
    """
    n = tree.num_nodes
    anc = torch.zeros(n + 1, n + 1, dtype=torch.bool)  # [N+1, N+1]
    anc[:, 0] = True  # everyone sees the root
    parents = tree.parents.tolist()
    for i in range(n):
        row = i + 1
        p = parents[i]
        if p >= 0:
            anc[row] = anc[p + 1]
        anc[row, row] = True
    past = torch.ones(n + 1, past_len, dtype=torch.bool)  # [N+1, past]
    mask = torch.cat([past, anc], dim=1)[None, None]  # [1, 1, N+1, past+N+1]
    return mask.to(device) if device is not None else mask


def tree_position_ids(tree: DraftTree, root_position: int, device: Optional[torch.device] = None) -> torch.Tensor:
    """Position ids int64 [1, N + 1]: the root at ``root_position``, each node one past its
    depth below it."""
    pos = torch.cat([torch.zeros(1, dtype=torch.long), tree.depth.to(torch.long) + 1]) + root_position
    pos = pos[None]  # [1, N+1]
    return pos.to(device) if device is not None else pos


def follow_path(tree: DraftTree, tokens: Sequence[int]) -> list[int]:
    """Node indices of the longest root path of ``tree`` whose tokens are a prefix of
    ``tokens``: what greedy verification accepts when the target's choices are ``tokens``.

    Example: tokens [5, 6, 7] with parents [-1, 0, -1] (5 then 6; 7) and tokens [5, 6, 9]
    -> [0, 1].
    """
    toks, parents = tree.tokens.tolist(), tree.parents.tolist()
    node, path = -1, []
    for t in tokens:
        nxt = next((i for i, p in enumerate(parents) if p == node and toks[i] == t), None)
        if nxt is None:
            break
        path.append(nxt)
        node = nxt
    return path


def path_to_node(tree: DraftTree, node: int) -> list[int]:
    """Node indices from the root's child down to ``node`` (inclusive)."""
    path = []
    parents = tree.parents.tolist()
    while node != -1:
        path.append(node)
        node = parents[node]
    return path[::-1]


def drop_invalid_nodes(tree: DraftTree, vocab_size: int) -> tuple[DraftTree, int]:
    """Drop the draft nodes a verification must never see, with their subtrees.

    A node is invalid when its token id is outside ``[0, vocab_size)`` (the target's
    embedding would fail on it), when its parent is not an earlier node (or -1), or when
    its depth is not its parent's depth + 1 (its position would be wrong). Every
    descendant of an invalid node is dropped too, so the rest is still a valid tree.

    Example: tokens [5, 99, 7, 8], parents [-1, -1, 1, 0], vocab_size 50: node 1 (id 99)
    is out of range and node 2 is its child; kept: tokens [5, 8], parents [-1, 0], depth
    [0, 1]; 2 dropped.

    Args:
        tree: a proposal (N nodes), as a drafter returned it.
        vocab_size: V, the number of token ids the target knows.

    Returns:
        (the kept nodes in their order with parents re-indexed, number of nodes dropped);
        ``tree`` itself (same object) when nothing is dropped.
    """
    n = tree.num_nodes
    if n == 0:
        return tree, 0
    tokens = tree.tokens.tolist()
    parents = tree.parents.tolist()
    depth = tree.depth.tolist()
    new_index = [-1] * n  # old node -> kept index, -1 = dropped
    kept: list[int] = []
    for i in range(n):
        p = parents[i]
        if not 0 <= tokens[i] < vocab_size or not -1 <= p < i:
            continue
        if p == -1:
            ok = depth[i] == 0
        else:
            ok = new_index[p] >= 0 and depth[i] == depth[p] + 1
        if ok:
            new_index[i] = len(kept)
            kept.append(i)
    return select_nodes(tree, [new_index[i] >= 0 for i in range(n)])


def select_nodes(tree: DraftTree, kept_mask: Sequence[bool]) -> tuple[DraftTree, int]:
    """The nodes of ``tree`` whose ``kept_mask`` is True, in their order, parents
    re-indexed: the mask must be parent-closed (a kept node's parent is kept).

    Returns:
        (the kept tree, nodes dropped); ``tree`` itself (same object) when nothing is dropped.
    """
    n = tree.num_nodes
    kept = [i for i in range(n) if kept_mask[i]]
    dropped = n - len(kept)
    if dropped == 0:
        return tree, 0
    if not kept:
        return DraftTree.empty(), dropped
    new_index = {old: new for new, old in enumerate(kept)}
    parents = tree.parents.tolist()
    idx = torch.tensor(kept, dtype=torch.long)  # [K]
    return (
        DraftTree(
            tokens=tree.tokens[idx],
            parents=torch.tensor([new_index[parents[i]] if parents[i] != -1 else -1 for i in kept], dtype=torch.long),
            depth=tree.depth[idx],
            sources=tuple(tree.sources[i] for i in kept) if len(tree.sources) == n else (),
            scores=None if tree.scores is None or tree.scores.shape[0] != n else tree.scores[idx],
            draft_probs=None if tree.draft_probs is None else tree.draft_probs[idx],
            match_len=tree.match_len,
            node_match_len=None if tree.node_match_len is None else tree.node_match_len[idx],
        ),
        dropped,
    )


def interleaved_tree(tokens: Sequence[int], branches: int, source: str = "synthetic") -> DraftTree:
    """A draft tree of ``tokens``: ``branches`` children of the root, each later node below
    the node ``branches`` before it (``branches`` chains, interleaved in node order): a tree,
    not a chain, of a given size, for timing a verification and for tests.

    Example: 7 tokens, 3 branches -> parents [-1, -1, -1, 0, 1, 2, 3], depths [0, 0, 0, 1, 1,
    1, 2]. No tokens: the empty tree.
    """
    n = len(tokens)
    if n == 0:
        return DraftTree.empty()
    parents = [-1 if j < branches else j - branches for j in range(n)]
    depth = [j // branches for j in range(n)]
    return DraftTree(
        tokens=torch.tensor([int(t) for t in tokens], dtype=torch.long),
        parents=torch.tensor(parents, dtype=torch.long),
        depth=torch.tensor(depth, dtype=torch.long),
        sources=(source,) * n,
        scores=torch.ones(n),
    )

"""The prefix tree (packing.mode: tree) as literal tables: these paths -> these nodes in this depth-first order,
these examples -> these packs; and the tree's properties over random paths."""

import random
from collections import defaultdict

import pytest

from packtrain.data.images import ImageRef
from packtrain.data.jsonl import Example
from packtrain.data.planner import plan_packs, plan_stats, plan_tree_packs
from packtrain.data.prefix_tree import build_tree, example_tree
from packtrain.data.tree_packs import attention_pairs


def nodes_of(tree) -> list[tuple[tuple[int, ...], int]]:
    return [(n.tokens, n.parent) for n in tree.nodes]


# (name, paths, expected nodes as (tokens, parent) in depth-first order, each path's nodes)
TREES = [
    ("one path", [(1, 2, 3)], [((1, 2, 3), -1)], [[0]]),
    ("two paths part", [(1, 2, 3), (1, 2, 4)], [((1, 2), -1), ((3,), 0), ((4,), 0)], [[0, 1], [0, 2]]),
    ("children by first token, not input order", [(5, 9), (5, 1), (2,)],
     [((2,), -1), ((5,), -1), ((1,), 1), ((9,), 1)], [[1, 3], [1, 2], [0]]),
    ("a path that is a prefix of another", [(1, 2, 3, 4), (1, 2)], [((1, 2), -1), ((3, 4), 0)], [[0, 1], [0]]),
    ("duplicates share every node", [(7, 8), (7, 8), (7,)], [((7,), -1), ((8,), 0)], [[0, 1], [0, 1], [0]]),
    ("1-token nodes at several depths", [(1, 2, 3), (1, 2, 4), (1, 5)],
     [((1,), -1), ((2,), 0), ((3,), 1), ((4,), 1), ((5,), 0)], [[0, 1, 2], [0, 1, 3], [0, 4]]),
    ("an empty path runs through no node", [(), (3,)], [((3,), -1)], [[], [0]]),
    ("a deep split after a shallow one", [(1, 2, 3, 4), (1, 2, 3, 5), (1, 6)],
     [((1,), -1), ((2, 3), 0), ((4,), 1), ((5,), 1), ((6,), 0)], [[0, 1, 2], [0, 1, 3], [0, 4]]),
]


@pytest.mark.parametrize("name, paths, expected, chains", TREES, ids=[t[0] for t in TREES])
def test_tree_tables(name, paths, expected, chains):
    tree = build_tree(paths)
    assert nodes_of(tree) == expected
    assert tree.paths == chains


def test_salts_keep_equal_tokens_apart():
    tree = build_tree([(1, 2), (1, 2), (1, 3)], salts=[("b.png",), (), ()])
    # salt () sorts first: (1, 2) and (1, 3) share 1; the image example's (1, 2) is a tree of its own
    assert nodes_of(tree) == [((1,), -1), ((2,), 0), ((3,), 0), ((1, 2), -1)]
    assert tree.paths == [[3], [0, 1], [0, 2]]


def random_paths(rng: random.Random) -> tuple[list[tuple[int, ...]], list[tuple]]:
    base = [tuple(rng.randrange(3) for _ in range(rng.randint(0, 9))) for _ in range(rng.randint(1, 4))]
    paths = []
    for _ in range(rng.randint(1, 14)):  # prefixes of a few bases, extended: shared runs, prefixes, duplicates
        b = rng.choice(base)
        paths.append(b[: rng.randint(0, len(b))] + tuple(rng.randrange(3) for _ in range(rng.randint(0, 3))))
    return paths, [rng.choice([(), ("x",)]) for _ in paths]


@pytest.mark.parametrize("seed", range(200))
def test_tree_properties_over_random_paths(seed):
    rng = random.Random(seed)
    paths, salts = random_paths(rng)
    tree = build_tree(paths, salts)
    for path, chain in zip(paths, tree.paths):
        assert sum((tree.nodes[n].tokens for n in chain), ()) == path  # its nodes spell it
        assert [tree.nodes[n].start for n in chain] == [0, *(tree.nodes[n].end for n in chain)][: len(chain)]
        if chain:
            assert tree.ancestors(chain[-1]) == chain[:-1]  # each node's parent the one before it
    for i, node in enumerate(tree.nodes):
        assert node.tokens and node.parent < i  # non-empty; a parent before its children
        assert node.children == sorted(c for c, m in enumerate(tree.nodes) if m.parent == i)
        assert node.start == (tree.nodes[node.parent].end if node.parent >= 0 else 0)
    # one position per distinct non-empty prefix of each salt
    assert tree.positions == len({(s, p[:k]) for p, s in zip(paths, salts) for k in range(1, len(p) + 1)})
    order = list(range(len(paths)))
    rng.shuffle(order)
    again = build_tree([paths[i] for i in order], [salts[i] for i in order])
    assert nodes_of(again) == nodes_of(tree)
    assert [again.paths[k] for k in range(len(order))] == [tree.paths[i] for i in order]


def reference_tree(paths, salts) -> tuple[list[tuple[tuple[int, ...], int]], list[list[int]]]:
    """A per-token trie of (salt, path), its runs of one child with no path ending inside compressed into nodes,
    walked depth-first (salts, then tokens, in order): (tokens, parent) per node and each path's nodes."""
    children, ends = defaultdict(set), set()
    for path, salt in zip(paths, salts):
        for k in range(len(path)):
            children[salt, path[:k]].add(path[k])
        ends.add((salt, path))
    nodes, where = [], {}

    def walk(salt, prefix, parent):
        for token in sorted(children[salt, prefix]):
            run = prefix + (token,)
            while len(children[salt, run]) == 1 and (salt, run) not in ends:
                run += tuple(children[salt, run])
            nodes.append((run[len(prefix):], parent))
            where[salt, run] = len(nodes) - 1
            walk(salt, run, len(nodes) - 1)

    for salt in sorted(set(salts)):
        walk(salt, (), -1)
    chains = [[where[salt, path[:k]] for k in range(1, len(path) + 1) if (salt, path[:k]) in where]
              for path, salt in zip(paths, salts)]
    return nodes, chains


# token ids around the byte boundaries of a key (1, 2, 3 and 4 bytes big-endian)
WIDE = [0, 1, 255, 256, 257, 65535, 65536, 2**24 - 1, 2**24, 2**31, 2**32 - 1]


@pytest.mark.parametrize("seed", range(300))
def test_tree_equals_a_per_token_trie(seed):
    rng = random.Random(seed)
    paths, salts = random_paths(rng)
    if seed % 2:  # wide token ids: the keys' byte order must sort them as numbers
        alphabet = rng.sample(WIDE, 3)
        paths = [tuple(alphabet[t] for t in p) for p in paths]
    if seed % 3 == 0:
        salts = None
    if seed % 5 == 0:  # long paths that part anywhere: near their end, early, or in between
        base = tuple(rng.randrange(4) for _ in range(400))
        paths = [base[: rng.choice([rng.randint(0, 400), rng.randint(380, 400), rng.randint(0, 20)])] + p
                 for p in paths]
    tree = build_tree(paths, salts)
    assert (nodes_of(tree), tree.paths) == reference_tree(paths, salts or [()] * len(paths))


def test_two_long_paths_part_at_every_position():
    """The tokens two paths share, wherever they part: their tree's tokens are the shared ones once and each
    one's rest."""
    rng = random.Random(0)
    base = tuple(rng.randrange(2**32) for _ in range(300))
    for length in (70, 300):
        for at in range(length):
            a = base[:length]
            b = a[:at] + (a[at] ^ 1 << rng.randrange(32),) + a[at + 1:] + (7,) * rng.randrange(3)
            assert build_tree([a, b]).positions == build_tree([b, a]).positions == len(a) + len(b) - at


P = (90, 91)


def ex(id: str, *tokens: int, prefix=P, images=()) -> Example:
    """An example whose continuation is ``tokens``: the last one its target."""
    return Example(id, prefix, tuple(tokens[:-1]), tuple(tokens[-1:]), images=images)


def packs_of(plan, examples) -> list[tuple[list[str], int]]:
    return [([examples[i].id for i in pack.examples], pack.positions) for pack in plan.packs]


# (name, token_budget, max_continuations, examples, expected packs as (ids, positions = |P| + tree tokens))
PACKS = [
    ("the whole tree fits: one pack", 13, 90,
     [ex("a", 1, 2, 3, 4), ex("b", 1, 2, 3, 5, 6), ex("c", 1, 2, 7, 8, 9), ex("d", 1, 2, 7, 8, 10, 11)],
     [(["a", "b", "c", "d"], 13)]),
    # one token short of the whole tree: the root "1 2" is split into its two subtrees, each pack computing it
    ("cut into subtrees by the budget", 12, 90,
     [ex("a", 1, 2, 3, 4), ex("b", 1, 2, 3, 5, 6), ex("c", 1, 2, 7, 8, 9), ex("d", 1, 2, 7, 8, 10, 11)],
     [(["c", "d"], 9), (["a", "b"], 8)]),
    # capacity 9 after P: "1 2" is split; w costs 2 in y's pack (which holds "1 2"), 4 anywhere else; z fits only
    # beside x (its full path, 3); a pack lists its examples in depth-first order ("1 2 8" before "9 ...")
    ("an item goes where its path is held", 11, 90,
     [ex("x", 9, 9, 9, 9, 9, 9), ex("y", 1, 2, 3, 4, 5, 6, 7), ex("z", 1, 2, 8), ex("w", 1, 2, 9, 9)],
     [(["y", "w"], 11), (["z", "x"], 11)]),
    ("duplicates share their path", 10, 90, [ex("a2", 1, 2, 3), ex("b", 1, 2, 4), ex("a1", 1, 2, 3)],
     [(["a1", "a2", "b"], 6)]),
    ("a path that is a prefix of another is no leaf", 10, 1, [ex("b", 1, 2, 3, 4), ex("a", 1, 2)],
     [(["a", "b"], 6)]),
    ("max_continuations counts leaves", 100, 2,
     [ex("c", 7), ex("b", 6), ex("a", 5), ex("a2", 5)], [(["a", "a2", "b"], 4), (["c"], 3)]),
    ("1-token nodes, the tree cut below its root", 6, 90, [ex("a", 1, 2, 3), ex("b", 1, 2, 4), ex("c", 1, 5)],
     [(["a", "b"], 6), (["c"], 4)]),
    # "1 2" ends a's path and does not fit with both subtrees: a goes with the pack holding "1 2" that has the
    # least room (both have 1: the oldest)
    ("paths ending at a split node", 8, 90, [ex("c", 1, 2, 6, 7, 8), ex("b", 1, 2, 3, 4, 5), ex("a", 1, 2)],
     [(["a", "b"], 7), (["c"], 7)]),
    # i's "1 2" stands for other inputs: 3 tokens of its own beside t's and u's 4 (text first)
    ("other images share nothing", 10, 90,
     [ex("t", 1, 2, 3), ex("i", 1, 2, 4, images=(ImageRef("a.png", (1, 2, 2)),)), ex("u", 1, 2, 5)],
     [(["t", "u", "i"], 9)]),
]


@pytest.mark.parametrize("name, budget, max_cont, examples, expected", PACKS, ids=[t[0] for t in PACKS])
def test_pack_tables(name, budget, max_cont, examples, expected):
    plan = plan_tree_packs(examples, budget, max_cont)
    assert set(plan.figures) >= {"packs_shared_prefix", "positions_shared_prefix"}  # a tree plan beside a flat one
    assert packs_of(plan, examples) == expected
    for seed in range(5):  # the input order changes nothing
        shuffled = random.Random(seed).sample(examples, len(examples))
        assert packs_of(plan_tree_packs(shuffled, budget, max_cont), shuffled) == expected


@pytest.mark.parametrize("seed", range(150))
def test_every_pack_is_the_tree_of_its_examples(seed):
    """Over random groups: every example planned once (or skipped: over the budget alone); a pack's positions and
    pairs are those of the tree of its examples, within the budget and max_continuations leaves."""
    rng = random.Random(seed)
    prompts = [(1,), (2, 2, 2)]
    examples = [ex(f"e{k}", *(p or (0,)), prefix=rng.choice(prompts)) for k, p in enumerate(random_paths(rng)[0])]
    budget, max_cont = rng.randint(12, 24), rng.randint(1, 4)
    plan = plan_tree_packs(examples, budget, max_cont, on_overflow="skip")
    assert plan.skipped == [i for i, e in enumerate(examples) if len(e.prefix_ids) + e.len_continuation > budget]
    assert sorted([i for pack in plan.packs for i in pack.examples] + plan.skipped) == list(range(len(examples)))
    for pack in plan.packs:
        prefix = len(plan.prompts[pack.prompt])
        tree = example_tree([examples[i] for i in pack.examples])
        assert pack.positions == prefix + tree.positions <= budget
        assert pack.attention_pairs == attention_pairs(prefix, tree)
        assert sum(not n.children for n in tree.nodes) <= max_cont


def test_over_the_budget_goes_by_on_overflow():
    examples = [ex("a", 1, 2, 3), ex("long", 1, 2, 3, 4, 5, 6, 7, 8, 9)]
    with pytest.raises(ValueError, match="example 'long' needs 11 positions"):
        plan_tree_packs(examples, 10, 90)
    plan = plan_tree_packs(examples, 10, 90, on_overflow="skip")
    assert (packs_of(plan, examples), plan.skipped) == ([(["a"], 5)], [1])


def test_stats_beside_shared_prefix():
    examples = [ex("a", 1, 2, 3), ex("b", 1, 2, 3, 4), ex("c", 1, 2, 5)]
    s = plan_stats(plan_tree_packs(examples, 100, 90), examples)
    # tree: "1 2", "3", "4", "5" after P: 5 tokens; flat: 3 + 4 + 3 continuation tokens, one P each way
    assert (s["positions_standalone"], s["positions_shared_prefix"], s["positions_packed"]) == (16, 12, 7)
    assert s["attention_pairs_packed"] == 3 + (2 * 2 + 3) + (1 * 4 + 1) + (1 * 5 + 1) + (1 * 4 + 1)
    assert s["attention_pairs_shared_prefix"] == 3 + (3 * 2 + 6) + (4 * 2 + 10) + (3 * 2 + 6)
    assert s["shared_prefix_position_ratio"] == 12 / 7


@pytest.mark.parametrize("seed", range(60))
def test_shared_prefix_figures_are_the_flat_plans(seed):
    """plan_stats's shared_prefix figures of a tree plan (counted without planning flat) equal those of
    plan_packs' own plan of the same examples."""
    rng = random.Random(seed)
    examples = [ex(f"e{k}", *(rng.randrange(3) for _ in range(rng.randint(1, 12))),
                   prefix=rng.choice([(1,), (2, 2, 2)]))
                for k in range(rng.randint(1, 40))]
    budget, max_cont = rng.randint(10, 30), rng.randint(1, 5)
    if all(len(e.prefix_ids) + e.len_continuation > budget for e in examples):
        return
    s = plan_stats(plan_tree_packs(examples, budget, max_cont, on_overflow="skip"), examples)
    flat = plan_stats(plan_packs(examples, budget, max_cont, on_overflow="skip"), examples)
    assert (s["packs_shared_prefix"], s["positions_shared_prefix"], s["attention_pairs_shared_prefix"]) == (
        flat["packs"], flat["positions_packed"], flat["attention_pairs_packed"])

"""The children a state proposes (the rules of Algorithm 3, the seed's §6.2).

Swap and remat act on the cheapest of the peak's tensors per byte saved (see
`pricing.ranked`), one at a time and in batches of 2 to 128, biggest first (a
training peak holds hundreds of saved activations: one tensor per step would
need hundreds of steps), with their users being the readers after the peak.
F-Tree rules: enable the best-scoring candidates, mutate n, lift, disable,
pack, unpack. TASO subset: see `algebra_gains`. Inverse rules: drop one of the latest
batches (de-swap, de-remat). Last, the same swap and remat families on a split
region's part ops, each made in every part (Note [rewrites inside the parts] in
`space`), and after them unpack.
"""
from __future__ import annotations

from ..analysis.ftree import coarsenings, largest_parts, least_parts, mutations, overlaps
from .algebra_gains import AlgebraGains, product_of
from .pricing import Ranked, batch_price, ranked
from ..ir.graph import Ref
from ..rules.remat import can_rematerialize, chain_to_live, swapped_copies
from ..rules.swap import rd_region
from ..rules.algebra import direct_readers
from ..rules.cat_conv import CAT, split_forms, split_sites
from .space import Batch, Remat, Space, Split, State, Swap, every_part
from .transfers import is_store

SINGLE = 4                 # single-tensor rewrites proposed per state and rule
BATCHES = (2, 4, 8, 16, 32, 64, 128)  # batch sizes proposed per state and rule
ENABLE = 6                 # F-Tree candidates proposed for enabling per state
UNDO = 3                   # latest batches an inverse rule may drop

# A proposal: (rule, plan, batches, names of the ops it touches).
Proposal = tuple[str, tuple, tuple, set]


def _touched(g, kind: str, specs, ids: dict | None = None) -> set:
    """Names of the ops a batch rewrites (the incremental scheduler's seeds); a
    swap or remat in a split region's part rewrites every part (``ids``: op
    name -> id in ``g``, given for those)."""
    touched = set()
    if kind == "split":     # the cat goes and its backwards change: schedule afresh
        return touched
    if ids is not None:
        specs = [t for s in specs for t in every_part(g, ids, s)]
    for s in specs:
        if kind == "merge":
            touched |= set(s.ops)
            continue
        if kind == "sink":    # the product it scaled is rewritten too
            touched.add(product_of(g, s.op))
        touched |= set(getattr(s, "users", ()))
        touched.add(s.producer if kind == "swap" else s.op)
        touched.update(getattr(s, "chain", ()))
    return touched


def _fission(space: Space, st: State, coarsen: bool = False
             ) -> tuple[list[Proposal], list[Proposal], list[Proposal]]:
    """F-Tree rules on the plan, as (packs, the rest, unpacks); rewrites are
    replayed on the new fission graph. Packs go before every other child: one
    state, and in a transformer split along the batch it is the biggest step
    there is (GPT-Neo split in 16: 0.256 -> 0.175); the latest found first.
    Unpacks go after every other child: they trade memory back for time, and
    with the F-Tree rules they took 12-18 s of a 60 s paper-BTLM search (lat
    1.10) to build the split in 16 unpacked (0.2599) before any rewrite in the
    parts of the packed one (0.167). With ``coarsen`` (a memory budget),
    fewer parts of one region (`coarsenings`) go with the unpacks: they too
    trade memory for time."""
    plan = dict(st.plan)
    packs, out, enables, unpacks = [], [], [], []
    for rule, new in mutations(space.cands, plan):
        key = tuple(sorted(new.items()))
        if rule == "pack":
            packs.insert(0, (rule, key, st.batches, set()))
        elif rule == "unpack":
            unpacks.append((rule, key, st.batches, set()))
        elif rule == "enable":
            (cid,) = set(new) - set(plan) or {None}
            if cid is None:
                continue
            enables.append((space.cands[cid].score, cid, key))
        else:
            out.append((rule, key, st.batches, set()))
    enables.sort(key=lambda t: (-t[0], t[1]))
    out += [("enable", key, st.batches, set()) for _, _, key in enables[:ENABLE]]
    if coarsen:
        unpacks += [(rule, tuple(sorted(new.items())), st.batches, set())
                    for rule, new in coarsenings(space.cands, plan)]
    return packs, out, unpacks


def batch_sizes(cands: list, r: Ranked, headroom: float | None) -> list[int]:
    """The batch sizes proposed from ``cands`` (ranked, cheapest per byte first),
    biggest first: BATCHES that there are enough candidates for. Under a latency
    budget (``headroom``: seconds the state has left under it) only those whose
    summed price fits, and the largest prefix that fits when it is none of them:
    a split step is often a few hundredths of a second under the budget, where
    the power of two above what fits costs a state of ~40 s to learn it is over
    (paper BTLM split in 16: 128 swaps in the parts went x1.085 -> x1.170, and
    the remats x1.132; 40-50 s each). The prices are meant as lower bounds
    (`batch_price`), but they are read off the state's order, which the child's
    schedule may change: `Search.lat_limit` asks for this only where children
    are expensive."""
    if headroom is None:
        return [k for k in sorted(BATCHES, reverse=True) if len(cands) >= k]
    fit, own, copies = 0, 0.0, 0.0
    for s in cands:
        own += r.price[s]
        copies += r.copy.get(s, 0.0)
        if max(own, copies - r.copy_idle) > headroom:
            break
        fit += 1
    sizes = {k for k in BATCHES if k <= fit}
    if 2 <= fit < max(BATCHES):
        sizes.add(fit)       # the biggest batch stays BATCHES' biggest
    return sorted(sizes, reverse=True)


def proposals(space: Space, st: State, algebra: AlgebraGains | None = None,
              lat_limit: float | None = None, coarsen: bool = False) -> list[Proposal]:
    """Children of ``st`` as (rule, plan, batches, touched op names), in the
    order the search evaluates them. ``algebra`` keeps the TASO prices of the
    plans seen so far (a search passes its own; None prices afresh).
    ``lat_limit`` (a latency budget, seconds): swap and remat batches are only
    proposed where their price fits in what ``st`` has left under it.
    ``coarsen`` (a memory budget): fewer parts of a region are proposed too."""
    algebra = algebra or AlgebraGains(space)
    r = ranked(space, st)
    out: list[Proposal] = []
    ids = {n.name: n.id for n in st.graph.nodes} if r.inner_swaps or r.inner_remats else None
    headroom = None if lat_limit is None else lat_limit - st.latency

    def add(rule, kind, specs, inner=False):
        if specs:
            out.append((rule, st.plan, st.batches + (Batch(kind, frozenset(specs)),),
                        _touched(st.graph, kind, specs, ids if inner else None)))

    def rewrites(swaps, remats, tag=""):
        # Big steps first: when the search is cut short (time, max_states) the
        # children it did evaluate are the ones that move the peak the most.
        fams = {"swap": swaps, "remat": remats}
        sizes = {kind: batch_sizes(cand, r, headroom) for kind, cand in fams.items()}
        seq = [(kind, k) for k in sorted(set(sizes["swap"]) | set(sizes["remat"]), reverse=True)
               for kind in fams if k in sizes[kind]]
        if headroom is not None and sizes["swap"]:
            # Within a latency budget the biggest swap batch that fits goes first:
            # its copies hide behind compute where recomputation adds time and
            # working memory (paper BTLM split in 16: 60 swaps in the parts came
            # to 0.1481 at x1.085, the 103 remats before them to 0.1577 at x1.100,
            # 34 s a state).
            seq.remove(("swap", sizes["swap"][0]))
            seq.insert(0, ("swap", sizes["swap"][0]))
        for kind, k in seq:
            add(f"{kind}{tag}x{k}", kind, fams[kind][:k], bool(tag))
        for kind, cand in fams.items():
            for s in cand[:SINGLE]:
                if headroom is None or batch_price(r, [s]) <= headroom:
                    add(kind + tag, kind, [s], bool(tag))

    rewrites(r.swaps, r.remats)
    splits = cat_splits(space, st)
    if len(splits) > 1:
        add(f"splitx{len(splits)}", "split", splits)
    for sp in splits[:SINGLE]:
        add("split", "split", [sp])
    # A trade alone frees copy time and moves no peak down (the recompute may
    # lift it): it is proposed with the next swaps that time pays for, the
    # state's own candidates (paper U-Net at lat 1.10: a ReLU traded, then two
    # more swaps, 0.360 -> 0.338 at x1.098; the trade alone 0.382, which a
    # search ranking children by peak never expands).
    for rm_specs, batches in exchanges(space, st):
        tag = f"exchange{'x' + str(len(rm_specs)) if len(rm_specs) > 1 else ''}"
        for k in (2, 4):
            if len(r.swaps) >= k:
                out.append((f"{tag}+swapx{k}", st.plan, batches + (Batch("swap", frozenset(r.swaps[:k])),),
                            set()))
    for batches in repoints(st):
        out.append(("repoint", st.plan, batches, set()))
    packs, fission, unpacks = _fission(space, st, coarsen)
    out = packs + out + fission
    for rule, specs in algebra.children(st):
        add(rule, rule.split("x")[0], specs)
    for i in range(max(0, len(st.batches) - UNDO), len(st.batches)):
        out.append((f"undo-{st.batches[i].kind}", st.plan,
                    st.batches[:i] + st.batches[i + 1:], set()))
    # Rewrites inside a split region's parts come last: each touches every part
    # (no incremental schedule) and costs a state several times a rewrite
    # outside, so a short search must not spend its states on them before the
    # rest (notebook 05's 5 s search at --mem 0.6 missed its budget when they
    # were mixed in). After a whole-step split nearly every activation is a
    # part's, the lists above are short and these come soon.
    rewrites(r.inner_swaps, r.inner_remats, "-in-parts")
    return out + unpacks


def cat_splits(space: Space, st: State) -> list[Split]:
    """The convolutions of the peak's cats that can run one per piece (Note [a
    convolution of a cat] in `rules.cat_conv`), biggest first: the cat's
    storage then goes, and its pieces are saved (and swapped or recomputed)
    as themselves. Each twice: whole, and its backward alone (Note [a backward
    of a cat, one per piece]), which is also proposed where the cat's input
    gradient is at the peak, and which is all there is to split of a cat that
    only backwards read (a fission part's recomputed cat)."""
    if not space.split_cats:
        return []
    g = st.graph
    rd = direct_readers(g)
    cats = [(size, ref) for size, ref in st.hot if g.nodes[ref.node].target == CAT]
    # a backward's input gradient: the cat it is the gradient of
    cats += [(size, g.nodes[ref.node].args[1]) for size, ref in st.hot_grads
             if isinstance(g.nodes[ref.node].args[1], Ref)
             and g.nodes[g.nodes[ref.node].args[1].node].target == CAT]
    out: list[Split] = []
    for _, ref in sorted(cats, key=lambda t: -t[0]):
        for v in sorted(rd.get(ref, ())):
            whole, bwd = split_forms(g, v, rd)
            if not (whole or bwd):
                continue
            name = g.nodes[v].name
            for sp in ([Split(name)] if whole else []) + ([Split(name, False)] if bwd else []):
                if sp not in out:
                    out.append(sp)
            break
    return out


def split_first(space: Space, root: State) -> State:
    """``root`` with the convolutions of a cat that run one per piece (Note [a
    convolution of a cat] in `rules.cat_conv`) for free: all of them where
    together they lower neither the peak nor the speed by the space's cost
    model (paper U-Net, simulated RTX 3090: the last block's alone takes the
    peak x0.91 at latency x0.998), else
    those that do not alone (paper U-Net++: a cat of five pieces costs four
    sums, all ten splits x1.005); then, the same way, the backwards alone of
    the others (Note [a backward of a cat, one per piece]). The search starts
    from it and every plan has them; the others are proposed for the peak's
    cats (`cat_splits`), after the swaps and remats already in a state (a
    swapped cat cannot be split)."""
    def trial(base, specs):
        b = Batch("split", frozenset(specs))
        g, batches = space.build(base.plan, base.batches + (b,))
        st = space.evaluate(base.plan, batches, g)
        return st if st.peak <= base.peak and st.latency <= base.latency else None

    st = root
    for forward in (True, False):
        sites = split_sites(st.graph, not forward) if space.split_cats else []
        specs = [Split(st.graph.nodes[i].name, forward) for i in sites]
        if not specs:
            continue
        nxt = trial(st, specs)
        if nxt is None and len(specs) > 1:
            free = [sp for sp in specs if trial(st, [sp]) is not None]
            nxt = trial(st, free) if free else None
        st = nxt or st
    return st


# Note [readers of a stored tensor]
# A swap's Load serves the readers after the peak of the state that proposed
# it (H2); the others read the original, which lives until the last of them.
# A later state can move one of those past its own peak: a recompute made
# before the swap (a ReLU remade from its conv output through BatchNorm) sat
# before the peak when the conv output's swap was proposed, and the schedule
# of a later state put it at the end of the backward, so the stored output
# stayed on the device from the forward to there. Each such reader is moved to
# the loaded copy (a "repoint" child; the Load then comes before it). Paper
# U-Net, lat 1.10 (simulated RTX 3090, 60 s): the first encoder conv's 512 MiB
# output, stored at step 33 and read by its recompute at step 312, was live
# through the peak; with the repoint child 0.2778 -> 0.2439 at x1.095.


def repoints(st: State) -> list[tuple]:
    """Note [readers of a stored tensor]: for each tensor at the peak that is
    swapped but still read in its original after the peak, the state's batches
    with those readers moved to the loaded copy."""
    g = st.graph
    pos = {v: i for i, v in enumerate(st.order)}
    rd = g.readers()
    out = []
    for _, r in st.hot:
        readers = rd.get(r, set())
        if not any(is_store(g, u) for u in readers):
            continue
        late = {g.nodes[u].name for u in readers if pos.get(u, -1) > st.peak_step
                and not is_store(g, u) and rd_region(g, u) == rd_region(g, r.node)}
        if not late:
            continue
        src, found, batches = g.nodes[r.node].name, False, []
        for b in st.batches:
            if b.kind == "swap" and not found:
                specs = set(b.specs)
                for s in b.specs:
                    if s.producer == src and s.out == r.out:
                        specs = (specs - {s}) | {Swap(s.producer, s.out, s.users | late)}
                        found = True
                b = Batch("swap", frozenset(specs))
            batches.append(b)
        if found:
            out.append(tuple(batches))
    return out


def exchanges(space: Space, st: State, limit: int = SINGLE) -> list[tuple]:
    """Swaps traded for recomputes (Note [recomputed from a loaded copy] in
    `rules.remat`): a swapped tensor that its op remakes, from tensors kept or
    loaded anyway, in less time than its copies take. The copy stream is what a
    latency budget runs out of first, and the first swap batches take the
    biggest tensors whether they recompute cheaply (a ReLU from its loaded conv
    output) or not. Each child drops one such swap from its batch and recomputes
    the tensor instead, cheapest per byte first; one more trades them all.
    Returns (remats, batches) pairs."""
    g = st.graph
    ids = {n.name: n.id for n in g.nodes}
    live = {r for _, r in st.hot} | set(swapped_copies(g))
    found = []
    for bi, b in enumerate(st.batches):
        if b.kind != "swap":
            continue
        for spec in b.specs:
            a = ids.get(spec.producer)
            if a is None or rd_region(g, a) or can_rematerialize(g, a) is not None:
                continue
            t = g.tensor(Ref(a, spec.out))
            chain = chain_to_live(g, a, live - {Ref(a, spec.out)})
            if chain is None:
                continue
            cost = sum(space.costs.recompute(g, v) for v in chain + [a])
            if cost >= 2 * space.costs.transfer_cost(t.nbytes):
                continue
            rm = Remat(spec.producer, spec.users, tuple(g.nodes[v].name for v in chain))
            found.append((cost / max(t.nbytes, 1), bi, spec, rm))
    found.sort(key=lambda f: f[0])

    def trade(chosen):
        drop: dict[int, set] = {}
        for _, bi, spec, _ in chosen:
            drop.setdefault(bi, set()).add(spec)
        batches = tuple(Batch(b.kind, b.specs - drop[i]) if i in drop else b
                        for i, b in enumerate(st.batches))
        batches = tuple(b for b in batches if b.specs)
        return [c[3] for c in chosen], batches + (Batch("remat", frozenset(c[3] for c in chosen)),)

    out = [trade([f]) for f in found[:limit]]
    # all at once: those whose recomputed ops overlap no earlier one's (a batch
    # recomputes each op once)
    together, used = [], set()
    for f in found:
        ops = {f[3].op, *f[3].chain}
        if not ops & used:
            together.append(f)
            used |= ops
    if len(together) > 1:
        out.append(trade(together))
    return out


def enable_top(space: Space, st: State) -> tuple | None:
    """The plan with the best-scoring F-Tree candidate that overlaps no enabled
    region enabled at its least n, or None. Algorithm 1 scores a candidate by
    the hot bytes it splits, so in a transformer this is the whole training
    step split along the batch; reaching it from the leaves takes a lift per
    F-Tree level, each waiting for its turn in the queue."""
    plan = dict(st.plan)
    taken = [space.cands[j].ops | space.cands[j].recompute for j in plan]
    for c in sorted(space.cands, key=lambda c: (-c.score, c.id)):
        if c.id in plan or any((c.ops | c.recompute) & ops for ops in taken):
            continue
        return tuple(sorted({**plan, c.id: least_parts(c.max_n)}.items()))
    return None


def enable_blocks(space: Space, st: State, n: int, comp: int) -> tuple | None:
    """The plan with every region of component ``comp`` that recomputes enabled
    together at the largest n up to ``n``, best-scoring first where two clash;
    None when that is fewer than two. Along the sequence these are each block's
    attention forward (making its rows of the causal mask) and each block's
    backward remaking its slices of the forward (Note [recomputed in parts] in
    `analysis/ftrans.py`): one block alone frees one block's saved tensors,
    which moves the peak little, so the queue, enabling one region a state,
    did not reach them (zoo GPT at 2048 tokens: 151 MiB simulated, where all of
    them at once make 31 MiB)."""
    plan = dict(st.plan)
    group = sorted((c for c in space.cands if c.recompute and c.comp == comp and not c.pack
                    and c.id not in plan), key=lambda c: (-c.score, c.id))
    added = 0
    for c in group:
        trial = {**plan, c.id: largest_parts(c.max_n, n)}
        if not overlaps(space.cands, trial, c.id):
            plan, added = trial, added + 1
    return tuple(sorted(plan.items())) if added >= 2 else None


"""Drafters that learn nothing: TLT-Base's n-gram lookup and the GRPO-sibling lookups, the
baselines the learned drafter (drafter.Drafter) must beat.

Each offers the one method the speculative step calls, `propose(batch, k) -> (drafts (B, k) long,
q (B, k, V) or None)`, None meaning deterministic proposals (a one-hot q), so the step never asks
what kind of drafter it holds:

    NgramDrafter       TLT-Base: the row's own text (prompt lookup)
    SiblingDrafter     the texts of the row's GRPO group, kept here in a GroupTexts per batch
    SiblingOrLearned   the learned drafter until every running row is the last of its group

They read only what speculative.RunningBatch offers a drafter: `tokens` (B, W), `n_tokens` (B,),
`ids` (the prompt each row is, on the host), and per prompt `prompts` and `results` (None while
the row runs, then its FinishedRow). A group is the rows of one distinct prompt; the core knows
nothing of groups.
`proposer` maps train.py's --drafter names to a drafter.

Test: python -m pytest tests/test_model_free.py
"""
import bisect
import weakref

import torch
import torch.nn.functional as F

from harness import instrument
from harness.instrument import check

DRAFTERS = ("learned", "ngram", "sibling", "sibling+learned")  # --drafter: what drafts in the tail
LEARNED = ("learned", "sibling+learned")  # the drafters whose learned part idle ranks train


def proposer(name, drafter):
    """What drafts for --drafter `name`; `drafter` is the learned one."""
    return {"learned": lambda: drafter, "ngram": NgramDrafter, "sibling": SiblingDrafter,
            "sibling+learned": lambda: SiblingOrLearned(drafter)}[name]()


class NgramDrafter:
    """TLT-Base (`--drafter ngram`). The paper also falls back on one while its learned drafter is
    not ready; here it is only the baseline: no run switches to it by itself.
    Prompt lookup: find the latest earlier place where the row's last n tokens occurred in its own
    prompt and response, and propose the k tokens that followed there; with no match, propose the
    last token again (it will most likely be rejected). It costs no forward pass and learns
    nothing, so it drafts well only where a response repeats itself, such as a re-check pass that
    goes over the sum again. Its proposal is a one-hot q, which rejection sampling accepts with
    probability p(d): the verify rules stay exact."""

    def __init__(self, n=3):
        self.n = n

    def propose(self, batch, k, noise=None):
        """A speculative.RunningBatch -> drafts (B, k) from its tokens (B, W), row b's first
        n_tokens[b] valid, and q = None: the proposals are deterministic (a one-hot q). The noise
        is not read."""
        tokens, n_tokens = batch.tokens, batch.n_tokens
        B, W = tokens.shape
        n, dev = self.n, tokens.device
        offs = torch.arange(n, device=dev)
        suffix = tokens.gather(1, (n_tokens[:, None] - n + offs).clamp(min=0))  # (B, n): the last n
        match = (tokens.unfold(1, n, 1) == suffix[:, None]).all(-1)  # (B, W - n + 1): j = suffix
        j = torch.arange(W - n + 1, device=dev)
        match &= j[None] < (n_tokens - n)[:, None]  # strictly earlier than the suffix itself
        start = torch.where(match, j[None], -1).max(1).values  # (B,) the latest match, -1 for none
        follow = (start + n)[:, None] + torch.arange(k, device=dev)  # (B, k)
        follow = torch.where(start[:, None] >= 0, follow, n_tokens[:, None] - 1)  # none: the last
        return tokens.gather(1, torch.minimum(follow, n_tokens[:, None] - 1)), None


MAX_SIBLINGS = 15  # a row's siblings, at most: a GRPO group of 16 in full (bounds a row's lookup)


class GroupTexts:
    """The texts a sibling lookup reads for one running batch. `group` (per original row, on the
    host): its distinct prompt, the rows sharing it being its GRPO group; `finished` (per row, or
    None): responses of its group that finished before the batch began (a rollout holds the whole
    group and has none; bench.py's decoding table starts in the tail).
    `texts` (R, width): every row's tokens by original row, stored when it finishes (`record`), then
    those earlier responses; `text_len` (R,); `siblings` (B, S): for each row, the texts of its
    group but its own, the MAX_SIBLINGS nearest in row order, -1 padding. A running row's text is
    read as it is now (`now`). Made once per batch from host lists, each in one copy."""

    def __init__(self, group, finished, prompts, width, device):
        B, finished = len(group), finished or [[]] * len(group)
        if len(finished) != B:
            raise ValueError(f"{len(finished)} lists of finished siblings for {B} prompts")
        extra = [(b, (prompts[b] + list(r))[:width]) for b in range(B) for r in finished[b]]
        padded = [t + [0] * (width - len(t)) for _, t in extra]
        extra_texts = torch.tensor(padded, dtype=torch.long, device=device).view(-1, width)
        own = torch.zeros(B, width, dtype=torch.long, device=device)  # stored as the rows finish
        self.texts = torch.cat([own, extra_texts])  # (R, width), R = B + the earlier responses
        lengths = [0] * B + [len(t) for _, t in extra]
        self.text_len = torch.tensor(lengths, dtype=torch.long, device=device)  # (R,)
        members = {}  # group -> its texts, in row order
        for i, g in enumerate(group + [group[b] for b, _ in extra]):
            members.setdefault(g, []).append(i)
        rows = []  # a row's siblings: the other members of its group, the MAX_SIBLINGS nearest
        for b in range(B):
            m = members[group[b]]
            at = bisect.bisect_left(m, b)
            lo = max(0, min(at - MAX_SIBLINGS // 2, len(m) - MAX_SIBLINGS - 1))
            rows.append([i for i in m[lo:lo + MAX_SIBLINGS + 1] if i != b][:MAX_SIBLINGS])
        self.group, self.n_siblings = group, [len(r) for r in rows]  # on the host, by original row
        S = max(1, max(map(len, rows)))
        self.siblings = torch.tensor([r + [-1] * (S - len(r)) for r in rows], dtype=torch.long,
                                     device=device)  # (B, S)
        self.waiting = list(range(B))  # the rows whose text is not stored yet (see `record`)

    def record(self, finished):
        """Store the texts of the rows that have finished since the last call, `finished` being
        RunningBatch.results: a host loop over the rows still waiting, each text copied on the
        device, its length the tensor's shape (known on the host): nothing is read back."""
        waiting = []
        for row in self.waiting:
            done = finished[row]
            if done is None:
                waiting.append(row)
                continue
            n = done.tokens.shape[0]  # prompt + response
            self.texts[row, :n].copy_(done.tokens)  # device to device
            self.text_len[row].fill_(n)  # a kernel argument, not a copy
        self.waiting = waiting

    def all_finished(self, running):
        """Whether every running row (original ids, on the host) has siblings and all of them have
        finished, i.e. no two running rows share a group."""
        groups = [self.group[i] for i in running]
        return len(set(groups)) == len(groups) and all(self.n_siblings[i] for i in running)

    def now(self, row_id, tokens, n_tokens):
        """Every text, the running rows' (original ids row_id (B,)) as they are now: (R, W), (R,)"""
        texts = self.texts.index_copy(0, row_id, tokens)
        return texts, self.text_len.index_copy(0, row_id, n_tokens)


class SiblingDrafter:
    """Drafts from the row's GRPO group (`--drafter sibling`). GRPO samples G responses per prompt,
    and in the tail the rows still running are the last of their groups: their siblings have
    written the same problem out already. For each row, find in every sibling's text (a finished
    one in full, a running one up to where it is) the place whose preceding tokens match the row's
    own last tokens the longest, up to max_match, and propose the k tokens that follow there; among
    equally long matches, the place closest to the row's own position (near-copies line up). No
    match: the row's last token again, like NgramDrafter.

    Brute force on the device: every window of every sibling against the row's last max_match
    tokens, B S W max_match comparisons a step (B rows, S siblings, W positions), no index to keep
    and no host read. A suffix automaton per group would cost O(k) a step, but on the host, which
    would need every new token there each step. A group dealt over several ranks drafts from the
    siblings on its own rank only: nothing crosses ranks in the tail (train.py's layout keeps
    every group on one rank whenever the ranks divide the rows evenly into whole groups).
    `finished`: per prompt, responses of its group that finished before the batch began."""

    def __init__(self, max_match=16, finished=None):
        self.max_match, self.finished = max_match, finished
        self._batch = self._groups = None  # the batch last seen (a weak reference), its GroupTexts

    def groups(self, batch):
        """The GroupTexts of `batch`: made the first time this drafter sees that batch object, then
        brought up to date with the rows that finished since the last look."""
        if self._batch is None or self._batch() is not batch:
            W, dev = batch.tokens.shape[1], batch.tokens.device
            distinct = {}  # a prompt's text -> its group
            group = [distinct.setdefault(tuple(p), len(distinct)) for p in batch.prompts]
            self._groups = GroupTexts(group, self.finished, batch.prompts, W, dev)
            self._batch = weakref.ref(batch)
        self._groups.record(batch.results)
        return self._groups

    def propose(self, batch, k, noise=None):
        """A speculative.RunningBatch -> drafts (B, k), and q = None: deterministic proposals."""
        return self.lookup(batch, k, self.groups(batch))[0], None

    def lookup(self, batch, k, groups):
        """-> drafts (B, k) and each row's match length (B,), 0 where no sibling matched.

        Reads from the batch: tokens (B, W), of which row b holds its first n_tokens[b]; ids, the
        rows' original ids; and from `groups` (a GroupTexts): siblings (B0, S) by
        original id, -1 padding; now(...) -> texts (R, W) and their lengths (R,). It relies on these
        invariants, checked when TLT_DEBUG=1 (instrument.check):
          1. k >= 1, and every running row holds 1 <= n_tokens <= W tokens (its last is read);
          2. a sibling is -1 (padding, matches nothing) or another row's text, 0 <= s < R, and a
             text holds at most W tokens;
          3. nothing past a text's length is read, the row's own or a sibling's: the row's last M
             tokens are read at n - M .. n - 1 (clamped at 0: copies of token 0, which capping a
             match at n tokens discounts), a match counts only where a token follows it within the
             sibling's text, and a draft past that text's end repeats its last token;
          4. with n_tokens <= W (1) every distance |follow - n| is below 2W, the score of one
             matched token, so the longest match wins and the closest breaks ties.
        Out: drafts (B, k), from a sibling where the length is positive, else the row's last
        token."""
        M, dev = self.max_match, batch.tokens.device
        B, W = batch.tokens.shape
        n = batch.n_tokens  # (B,) the row's next position; its last token is the pending one
        ids = torch.tensor(batch.ids, device=dev)  # (B,)
        texts, lens = groups.now(ids, batch.tokens, batch.n_tokens)  # (R, W), (R,)
        sib = groups.siblings[ids]  # (B, S) the row's siblings' texts, -1 padding
        if instrument.DEBUG:
            _check_inputs(k, n, W, texts, lens, sib, ids)
        cand = texts[sib.clamp(min=0)]  # (B, S, W)
        cand_len = torch.where(sib >= 0, lens[sib.clamp(min=0)], 0)  # (B, S); padding: empty
        at = (n[:, None] - M + torch.arange(M, device=dev)).clamp(min=0)  # (B, M)
        if instrument.DEBUG:
            check(at < n[:, None], "the row's tokens are read below n_tokens only (3)")
        suffix = batch.tokens.gather(1, at)  # (B, M) the row's last M tokens
        padded = F.pad(cand, (M - 1, 0), value=-1)  # (B, S, M - 1 + W): -1 matches no token
        windows = padded.unfold(2, M, 1)[:, :, :W - 1]  # (B, S, W - 1, M): window j ends at j
        same = (windows == suffix[:, None, None]).flip(-1).to(torch.uint8)
        run = same.cumprod(-1).sum(-1)  # (B, S, W - 1): how many of the row's last tokens end at j
        follow = torch.arange(1, W, device=dev)  # (W - 1,) the position after window j
        run = torch.where(follow < cand_len[..., None], run, 0)  # a token follows, in the text (3)
        run = torch.minimum(run, n[:, None, None])  # a row shorter than M: its own tokens only
        score = run * 2 * W - (follow - n[:, None, None]).abs()  # longest first, then closest (4)
        best = score.flatten(1).argmax(1)  # (B,)
        length = run.flatten(1).gather(1, best[:, None])[:, 0]  # (B,)
        rows = torch.arange(B, device=dev)
        s, start = best // (W - 1), best % (W - 1) + 1  # (B,) the sibling, its first follower
        end = cand_len[rows, s][:, None] - 1  # (B, 1) the sibling text's last position
        pos = torch.minimum(start[:, None] + torch.arange(k, device=dev), end).clamp_(min=0)
        if instrument.DEBUG:
            read = (sib[rows, s] >= 0) & (pos <= end).all(1)  # (B,)
            check((length == 0) | read, "drafts read a real sibling within its text (3)")
            check(length <= torch.clamp(n, max=M), "a match is at most min(M, n_tokens) long (3)")
        drafts = cand[rows, s].gather(1, pos)  # (B, k); past the text's end: its last token again
        last = batch.tokens.gather(1, n[:, None] - 1).expand(B, k)
        return torch.where(length[:, None] > 0, drafts, last), length


def _check_inputs(k, n, W, texts, lens, sib, row_id):
    """SiblingDrafter.lookup's invariants 1 and 2, on its inputs (debug runs only: each reads)."""
    check(k >= 1 and texts.shape[1] == W, f"k >= 1 (k = {k}) and texts as wide as the rows (1)")
    check((n >= 1) & (n <= W), "1 <= n_tokens <= W (1)")
    check((sib >= -1) & (sib < texts.shape[0]) & (sib != row_id[:, None]),
          "siblings are -1 or another row's text (2)")
    check(lens <= W, "texts hold at most W tokens (2)")


class SiblingOrLearned:
    """`--drafter sibling+learned`: the learned drafter while any running row has a sibling still
    running (or none), the sibling drafter once every running row is the last of its group: then
    sibling drafts cost no forward pass; before, a row's siblings are no further than it is. The
    choice reads only the host's `running`, never a draw: both verify rules stay exact."""

    def __init__(self, learned, max_match=16, finished=None):
        self.learned, self.siblings = learned, SiblingDrafter(max_match, finished)

    def propose(self, batch, k, noise=None):
        tail = self.siblings.groups(batch).all_finished(batch.ids)
        return (self.siblings if tail else self.learned).propose(batch, k, noise)

"""train.py --drafter ngram|sibling: drafters that learn nothing, the baselines the learned drafter
must beat. Each offers the one method the speculative step calls, `propose(batch, k, noise) ->
(drafts (B, k), q)`, q None meaning deterministic proposals (a one-hot q), and reads only what
speculative.RunningBatch offers a drafter (tokens, n_tokens, ids, prompts, results).

Test: python -m pytest tests/test_model_free.py
"""
import weakref

import torch
import torch.nn.functional as F

DRAFTERS = ("learned", "ngram", "sibling")  # --drafter: what drafts in the tail
LEARNED = ("learned",)  # the drafters that idle ranks train
MAX_SIBLINGS = 15  # a row's siblings, at most: a GRPO group of 16 in full (bounds the lookup)


def proposer(name, drafter):
    """What drafts for --drafter `name`; `drafter` is the learned one."""
    made = {"ngram": NgramDrafter, "sibling": SiblingDrafter}
    return made[name]() if name in made else drafter


class NgramDrafter:
    """TLT-Base (`--drafter ngram`), prompt lookup: find the latest earlier place where the row's
    last n tokens occurred in its own prompt and response, and propose the k tokens that followed
    there; with no match, the last token again (most likely rejected). It costs no forward pass
    and drafts well only where a response repeats itself. The paper also falls back on it while
    its learned drafter is not ready; here no run switches to it by itself."""

    def __init__(self, n=3):
        self.n = n

    def propose(self, batch, k, noise=None):
        """Drafts (B, k) from the batch's tokens (B, W), row b's first n_tokens[b] valid; q None."""
        tokens, n_tokens = batch.tokens, batch.n_tokens
        B, W = tokens.shape
        n, dev = self.n, tokens.device
        suffix_at = (n_tokens[:, None] - n + torch.arange(n, device=dev)).clamp(min=0)
        suffix = tokens.gather(1, suffix_at)  # (B, n): the last n tokens
        match = (tokens.unfold(1, n, 1) == suffix[:, None]).all(-1)  # (B, W - n + 1)
        j = torch.arange(W - n + 1, device=dev)
        match &= j[None] < (n_tokens - n)[:, None]  # strictly before the suffix itself
        start = torch.where(match, j[None], -1).max(1).values  # (B,) the latest match, or -1
        follow = (start + n)[:, None] + torch.arange(k, device=dev)  # (B, k)
        last = n_tokens[:, None] - 1
        follow = torch.where(start[:, None] >= 0, follow, last)  # no match: the last token
        return tokens.gather(1, torch.minimum(follow, last)), None


class GroupTexts:
    """The texts a sibling lookup reads for one running batch. A group is the rows of one distinct
    prompt. `texts` (B, W): every row's tokens by original row, stored when it finishes (`record`);
    `text_len` (B,); `siblings` (B, S): for each row, the other rows of its group (at most
    MAX_SIBLINGS), -1 padding. A running row's text is read as it is now (`now`)."""

    def __init__(self, prompts, width, device):
        distinct = {}  # a prompt's text -> its group
        self.group = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]
        B = len(prompts)
        self.texts = torch.zeros(B, width, dtype=torch.long, device=device)
        self.text_len = torch.zeros(B, dtype=torch.long, device=device)
        members = {}
        for i, g in enumerate(self.group):
            members.setdefault(g, []).append(i)
        rows = [[i for i in members[g] if i != b][:MAX_SIBLINGS] for b, g in enumerate(self.group)]
        S = max(1, max(len(r) for r in rows))
        padded = [r + [-1] * (S - len(r)) for r in rows]
        self.siblings = torch.tensor(padded, dtype=torch.long, device=device)  # (B, S)
        self.waiting = list(range(B))  # the rows whose text is not stored yet

    def record(self, results):
        """Store the texts of the rows that have finished since the last call (RunningBatch's
        `results`), device to device: nothing is read back."""
        waiting = []
        for row in self.waiting:
            done = results[row]
            if done is None:
                waiting.append(row)
                continue
            n = done.tokens.shape[0]  # prompt + response, known on the host
            self.texts[row, :n].copy_(done.tokens)
            self.text_len[row].fill_(n)
        self.waiting = waiting

    def now(self, row_id, tokens, n_tokens):
        """Every text, the running rows' (original ids row_id (B,)) as they are now: (B, W), (B,)"""
        texts = self.texts.index_copy(0, row_id, tokens)
        return texts, self.text_len.index_copy(0, row_id, n_tokens)


class SiblingDrafter:
    """Drafts from the row's GRPO group (`--drafter sibling`): in the tail the rows still running are
    the last of their groups, whose siblings wrote the same problem out. For each row, the place in a
    sibling's text whose preceding tokens match the row's last ones longest (up to max_match), and the
    k tokens after it; no match: the row's last token again. On the device, no host read; a group dealt
    over ranks drafts from the siblings on its own rank only."""

    def __init__(self, max_match=16):
        self.max_match = max_match
        self._batch = self._groups = None  # the batch last seen (a weak reference), its GroupTexts

    def groups(self, batch):
        """The GroupTexts of `batch`, made the first time this drafter sees it, then brought up to
        date with the rows that finished since."""
        if self._batch is None or self._batch() is not batch:
            self._groups = GroupTexts(batch.prompts, batch.tokens.shape[1], batch.tokens.device)
            self._batch = weakref.ref(batch)
        self._groups.record(batch.results)
        return self._groups

    def propose(self, batch, k, noise=None):
        return self.lookup(batch, k, self.groups(batch))[0], None

    def lookup(self, batch, k, groups):
        """-> drafts (B, k) and each row's match length (B,), 0 where no sibling matched. A match
        counts only where a token follows it within the sibling's text, so nothing past a text's
        length is read; a draft past that text's end repeats its last token."""
        M, dev = self.max_match, batch.tokens.device
        B, W = batch.tokens.shape
        n = batch.n_tokens  # (B,)
        ids = torch.tensor(batch.ids, device=dev)  # (B,)
        texts, lens = groups.now(ids, batch.tokens, n)  # (B0, W), (B0,) by original row
        sib = groups.siblings[ids]  # (B, S), -1 padding
        cand = texts[sib.clamp(min=0)]  # (B, S, W)
        cand_len = torch.where(sib >= 0, lens[sib.clamp(min=0)], 0)  # (B, S); padding: empty
        at = (n[:, None] - M + torch.arange(M, device=dev)).clamp(min=0)  # (B, M)
        suffix = batch.tokens.gather(1, at)  # (B, M) the row's last M tokens
        padded = F.pad(cand, (M - 1, 0), value=-1)  # (B, S, M - 1 + W): -1 matches no token
        windows = padded.unfold(2, M, 1)[:, :, :W - 1]  # (B, S, W - 1, M): window j ends at j
        same = (windows == suffix[:, None, None]).flip(-1).to(torch.uint8)
        run = same.cumprod(-1).sum(-1)  # (B, S, W - 1): the row's last tokens matched ending at j
        follow = torch.arange(1, W, device=dev)  # (W - 1,) the position after window j
        run = torch.where(follow < cand_len[..., None], run, 0)  # a token follows, in the text
        run = torch.minimum(run, n[:, None, None])  # a row shorter than M: its own tokens only
        # longest first, then closest: a distance |follow - n| < 2W never outweighs a matched token
        score = run * 2 * W - (follow - n[:, None, None]).abs()
        best = score.flatten(1).argmax(1)  # (B,)
        length = run.flatten(1).gather(1, best[:, None])[:, 0]  # (B,)
        rows = torch.arange(B, device=dev)
        s, start = best // (W - 1), best % (W - 1) + 1  # (B,) the sibling, its first follower
        end = cand_len[rows, s][:, None] - 1  # (B, 1) the sibling text's last position
        pos = torch.minimum(start[:, None] + torch.arange(k, device=dev), end).clamp_(min=0)
        drafts = cand[rows, s].gather(1, pos)  # (B, k)
        last = batch.tokens.gather(1, n[:, None] - 1).expand(B, k)
        return torch.where(length[:, None] > 0, drafts, last), length


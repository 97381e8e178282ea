"""Lossless speculative decoding, batched, in plain PyTorch.

One speculative step, for every running row at once:

1. draft: the drafter proposes k tokens (`drafter.propose(batch, k)`, the one method every drafter
   offers) and, for rejection sampling, their distributions q;
2. verify: the target reads [pending token, d_1 .. d_k] in one forward pass (k + 1 positions);
3. accept: each row keeps its own number of drafts (ragged acceptance) and emits one token of the
   target's after them; rolling the rejected drafts back is assigning the cache lengths.

The batch's sampler (sampling.py, one chosen per batch) picks every token and verifies the drafts;
both its rules are exact, and with "gumbel" plain and speculative decoding emit the same tokens.

`RunningBatch` holds the running rows; finished rows leave it (`compact`), so the batch really
shrinks. The host keeps bounds instead of reading the device: a step reads it once, in `compact`.

Test: python -m pytest tests/test_speculative.py
"""
from typing import NamedTuple

import torch

from sampling import Sampling
from sampling import verify  # noqa: F401  (the reference rule is also speculative.verify)


class FinishedRow(NamedTuple):
    """A row that left the running batch."""
    response: list  # generated ids (ending with <|eos|> when it stopped on one); read by `results`
    tokens: torch.Tensor  # (N,) prompt + response
    hidden: torch.Tensor  # (N - 1, C): hidden[j], the target's final state after reading tokens[j]
    prompt_len: int


class RunningBatch:
    """The running rows of one generate or rollout call.

    Row b holds tokens[b, :n_tokens[b]], prompt then response; its last token is *pending*, sampled
    but not yet read by the target, so the target's cache holds n_tokens - 1 positions, and
    hidden[b, j] is the target's state after reading tokens[b, j]. The host keeps, without reading
    the device: `running`, the original row of each slot; `tokens_bound` >= every n_tokens (it
    sizes the attention windows); `unread_bound` >= how many recorded states the learned drafter
    has not read (its catch-up width); and, as of the last `compact`, `generated`, the tokens the
    batch has generated so far, all rows."""

    def __init__(self, target, prompts, max_new_tokens, *, max_draft=0, **sampling):
        s = Sampling(**sampling)
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts must be a non-empty list of non-empty token lists")
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
        longest_prompt = max(len(p) for p in prompts)
        need = longest_prompt + max_new_tokens + max_draft  # a verify pass writes k past the end
        if need > target.config.block_size:
            raise ValueError(f"prompt ({longest_prompt}) + max_new_tokens ({max_new_tokens}) + "
                             f"draft ({max_draft}) = {need} exceeds block_size "
                             f"{target.config.block_size}")
        dev, B, width = target.wte.weight.device, len(prompts), need + 1
        self.target, self.eos_id, self.prompts = target, s.eos_id, prompts
        self.running, self.prompt_lens = list(range(B)), [len(p) for p in prompts]  # host only
        self.max_row_tokens = longest_prompt + max_new_tokens  # no row grows past it
        self.generated, self._live_tokens = 0, sum(self.prompt_lens)  # see `compact`
        self.tokens = torch.tensor([p + [0] * (width - len(p)) for p in prompts], device=dev)
        self.hidden = torch.zeros(B, width, target.config.n_embd, device=dev,
                                  dtype=target.wte.weight.dtype)  # (B, width, C)
        self.row_id = torch.arange(B, device=dev)  # the device's `running`
        self.sampler = s.new_sampler(B, width, target.config.vocab_size, dev)
        self.cache = target.new_cache(B, max_len=need)
        self.draft_cache = self.unread_bound = None  # a learned drafter's, from its first draft
        self.finished, self._unread_responses = [None] * B, []  # see `results`
        self._prefill(longest_prompt, max_new_tokens)

    def _prefill(self, longest_prompt, max_new_tokens):
        """Each distinct prompt once (a GRPO group repeats its prompt G times), in one padded
        pass; its cache entries go to the rows that share it; each row samples its first token."""
        dev = self.tokens.device
        index = {}  # distinct prompt -> its index
        self.group = [index.setdefault(tuple(p), len(index)) for p in self.prompts]  # by row
        firsts = torch.tensor([self.group.index(u) for u in range(len(index))], device=dev)
        inverse = torch.tensor(self.group, device=dev)
        prompt_len = torch.tensor(self.prompt_lens, device=dev)  # (B,)
        once = self.target.new_cache(len(index), max_len=longest_prompt)
        once.window = longest_prompt
        logits, hidden = self.target(self.tokens[firsts, :longest_prompt], once)  # (U, T, V|C)
        self.cache.kv[..., :longest_prompt, :] = once.kv[:, :, inverse]
        self.cache.lengths = prompt_len  # the padding's entries are dead
        self.hidden[:, :longest_prompt] = hidden[inverse]
        self.end = prompt_len + max_new_tokens  # (B,) a row is done at this many tokens
        self.n_tokens = prompt_len.clone()
        self.done = torch.zeros(len(self.prompts), dtype=torch.bool, device=dev)
        self.sampler.start_step(prompt_len[:, None])
        first, _ = self.sampler.choose(logits[inverse, prompt_len - 1][:, None])  # (B, 1)
        self._append(first)
        self.tokens_bound = longest_prompt + 1

    @property
    def batch_size(self):
        return self.row_id.shape[0]

    def _append(self, new, n_new=None):
        """Write new (B, W) tokens after each row's end, row b keeping its first n_new[b] (default
        all); cut after the first <|eos|> and at max_new_tokens, marking those rows done.
        Returns the tokens kept per row (B,)."""
        W = new.shape[1]
        # writes past what is kept land beyond the row's end: dead
        self.tokens.scatter_(1, self.n_tokens[:, None] + self.cache.offsets[:W], new)
        budget = self.end - self.n_tokens  # (B,)
        n_kept = budget.clamp_(max=W) if n_new is None else torch.minimum(n_new, budget)
        if self.eos_id is not None:  # keep up to the first <|eos|> among the kept tokens
            before = (new != self.eos_id).cummin(1).values.sum(1)  # (B,) tokens before it
            self.done |= before < n_kept
            n_kept = torch.minimum(n_kept, before + 1)
        self.n_tokens = self.n_tokens + n_kept
        self.done |= self.n_tokens >= self.end
        return n_kept

    @torch.no_grad()
    def plain_step(self):
        """One token for every running row. Returns the tokens emitted per row (B,)."""
        L = self.n_tokens - 1  # (B,) the target cache's length; tokens[L] is pending
        self.cache.window = self.tokens_bound  # the longest row after the append: no read
        logits, hidden = self.target(self.tokens.gather(1, L[:, None]), self.cache)  # (B, 1, .)
        self.hidden[self.cache.rows, L] = hidden[:, 0]
        self.sampler.start_step(self.n_tokens[:, None])
        nxt, _ = self.sampler.choose(logits)  # (B, 1)
        self.tokens_bound = min(self.tokens_bound + 1, self.max_row_tokens)
        if self.unread_bound is not None:
            self.unread_bound += 1
        return self._append(nxt)

    @torch.no_grad()
    def speculative_step(self, drafter, k):
        """Draft k tokens per row, verify them in one target pass, keep a ragged number per row.
        Returns (tokens emitted per row, drafts accepted per row)."""
        L = self.n_tokens - 1  # (B,) the target cache's length; tokens[L] is pending
        positions = self.n_tokens[:, None] + self.cache.offsets[:k + 1]  # (B, k+1)
        self.sampler.start_step(positions)
        # 1. draft: k tokens per row, and q (B, k, V) or None (deterministic proposals)
        draft, q = drafter.propose(self, k)  # (B, k)
        # 2. verify: the target reads the pending token and the k drafts in one pass
        self.cache.window = self.tokens_bound + k
        pending = self.tokens.gather(1, L[:, None])  # (B, 1)
        logits, hidden = self.target(torch.cat([pending, draft], 1), self.cache)  # (B, k+1, .)
        self.hidden[self.cache.rows[:, None], positions - 1] = hidden  # rejected ones: dead
        # 3. accept: row b keeps its first n_acc[b] drafts and one token of the target's
        n_acc, out = self.sampler.verify(draft, q, logits)  # (B,), (B, k+1)
        n_emitted = self._append(out, n_acc + 1)
        self.cache.lengths = self.n_tokens - 1  # roll the rejected drafts back
        self.tokens_bound = min(self.tokens_bound + k + 1, self.max_row_tokens)
        if self.unread_bound is not None:  # whoever drafted, the learned drafter has not read these
            self.unread_bound += k + 1
        return n_emitted, n_acc

    def compact(self):
        """Move finished rows to `finished` and out of every tensor and cache: the live rows past
        the new end fill the holes before it, so a few rows move, not the whole cache. Returns the
        rows still running, and counts the tokens written since the last compact in `generated`."""
        B = self.batch_size
        if B == 0:
            return 0
        # sync: the step's one read: which rows finished, with every row's length
        done, n_tokens = torch.stack((self.done, self.n_tokens)).tolist()
        live = [b for b in range(B) if not done[b]]
        self.generated += sum(n_tokens) - self._live_tokens
        self._live_tokens = sum(n_tokens[b] for b in live)
        self.tokens_bound, n = max((n_tokens[b] for b in live), default=0), len(live)
        if n == B:
            return B
        for b in (b for b in range(B) if done[b]):  # responses are read later, together
            row = self.running[b]
            self.finished[row] = FinishedRow(None, self.tokens[b, :n_tokens[b]].clone(),
                                             self.hidden[b, :n_tokens[b] - 1].clone(),
                                             self.prompt_lens[row])
            self._unread_responses.append(row)
        # host: slot b < n keeps its row, or takes the next live row past n
        movers = iter([b for b in live if b >= n])
        self.running = [self.running[b] if not done[b] else self.running[next(movers)]
                        for b in range(n)]
        # device: the same moves, from the done mask, so no index crosses from the host: the live
        # slots in order, then the finished ones (uint8: CUDA sorts no bool before torch 2.6)
        order = torch.argsort(self.done.to(torch.uint8), stable=True)  # (B,)
        holes = sum(done[:n])  # finished slots before the new end = live slots past it
        slots, rows = order[n:n + holes], order[n - holes:n]  # slots[i] gets slot rows[i]'s row
        for name in ("tokens", "hidden", "end", "row_id", "n_tokens", "done"):
            t = getattr(self, name)
            t[slots] = t[rows]  # the right side is a copy: safe in any order
            setattr(self, name, t[:n])
        for keeper in (self.cache, self.draft_cache, self.sampler):
            if keeper is not None:
                keeper.compact(n, slots, rows)
        return n

    @property
    def results(self):
        """Per original row, its FinishedRow once finished, else None. The responses finished since
        the last look are read here, in one read: a rollout reads them once, at the end."""
        rows, self._unread_responses = self._unread_responses, []
        if rows:  # sync: one read
            f = self.finished
            ids = torch.cat([f[r].tokens[f[r].prompt_len:] for r in rows]).tolist()
            for r in rows:
                n = len(f[r].tokens) - f[r].prompt_len
                f[r], ids = f[r]._replace(response=ids[:n]), ids[n:]
        return self.finished

    def outputs(self):
        return [r.response for r in self.results]


class Step(NamedTuple):
    """One decoding step, as the generate functions and the rollout tell an observer of it."""
    batch_size: int  # running rows before the step
    k: int  # drafts per row; 0: a plain step
    n_emitted: torch.Tensor  # (batch_size,) tokens each row kept
    n_accepted: torch.Tensor  # (batch_size,) drafts each row accepted; None for a plain step


@torch.no_grad()
def generate_batch(batch, drafter=None, k=0, observer=None):
    """Run a RunningBatch until every row has finished: plain steps (k = 0) or speculative ones with
    k drafts. observer(batch, step): after the prefill (step None) and after every step's
    compaction (a Step); the harness counts and times there. -> (outputs, {"accept_len": tokens
    per row per verify step, None without speculative steps}), counted from `generated`."""
    running, row_steps = batch.compact(), 0  # sync: one read a step, in compact
    first = batch.generated  # the prefill's tokens
    if observer:
        observer(batch, None)
    while running:
        B = batch.batch_size
        n_emitted, n_acc = batch.speculative_step(drafter, k) if k else (batch.plain_step(), None)
        running, row_steps = batch.compact(), row_steps + B
        if observer:
            observer(batch, Step(B, k, n_emitted, n_acc))
    accept_len = (batch.generated - first) / row_steps if k and row_steps else None
    return batch.outputs(), {"accept_len": accept_len}


def autoregressive_generate(target, prompts, max_new_tokens, *, observer=None, **sampling):
    """Plain decoding, one token per row per target pass; finished rows leave the batch.
    sampling: `Sampling`'s fields by name; observer: see `generate_batch`."""
    batch = RunningBatch(target, prompts, max_new_tokens, **sampling)
    return generate_batch(batch, observer=observer)


def speculative_generate(target, drafter, prompts, max_new_tokens, *, k=4, observer=None,
                         **sampling):
    """Speculative decoding with the same k for every row and step. With sampler "gumbel" and the
    same keys it emits exactly autoregressive_generate's tokens."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    batch = RunningBatch(target, prompts, max_new_tokens, max_draft=k, **sampling)
    return generate_batch(batch, drafter, k, observer)

"""After each step: append the sampled tokens, fork choices, advance beams, stop sequences, build RequestOutputs."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from engine.core.output.pooling import finish, fold
from engine.core.scheduling.sequence import Sequence, SequenceGroup
from engine.core.scheduling.step import Sample, ScheduledSeq, StepResult
from engine.outputs import CompletionDelta, Logprob, PoolingOutput, PositionLogprobs, RequestOutput
from engine.text.detokenizer import Detokenizer, token_bytes, token_text


class OutputProcessor:
    """Turns one step's samples into sequence state and the deltas each request reports."""

    def __init__(self, tokenizer, max_model_len: int, new_seq_id: Callable[[], int]) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.new_seq_id = new_seq_id
        self._pieces: dict[int, tuple[str, bytes]] = {}  # token id -> its text and bytes, for logprobs
        # What this step changed on the KV side, handed to Scheduler.postprocess (the pages' one owner).
        self.forks: list[tuple[Sequence, Sequence]] = []  # (parent, child)
        self.finished: list[Sequence] = []

    def take_page_changes(self) -> tuple[list[tuple[Sequence, Sequence]], list[Sequence]]:
        """(new forks as (parent, child), finished sequences) since the last call."""
        changes = (self.forks, self.finished)
        self.forks, self.finished = [], []
        return changes

    def process(
        self, group: SequenceGroup, items: list[tuple[int, ScheduledSeq]], result: StepResult
    ) -> RequestOutput | PoolingOutput | None:
        """items: this group's (index in the step, scheduled sequence). Raises what failed for this group."""
        if group.pools:
            return self._pool(group, items, result)
        for i, s in items:
            if i in result.errors:
                raise result.errors[i]
            if i in result.prompt_logprobs:
                self._store_prompt_logprobs(group, s.start, result.prompt_logprobs[i])
        sampled = [(s.seq, result.samples[i]) for i, s in items if i in result.samples]
        if not sampled:
            return None  # a prefill chunk: nothing to report yet
        if group.beam is not None:
            self._beam_step(group, {seq.seq_id: samples for seq, samples in sampled})
            return self._final(group) if group.finished else None
        if not group.forked:
            self._fork(group)
            ((_, samples),) = sampled
            deltas = [self._append(group, seq, sample) for seq, sample in zip(group.seqs, samples, strict=True)]
        else:
            deltas = [self._extend(group, seq, samples) for seq, samples in sampled]
        if group.params.num_sequences > group.params.n:
            return self._final(group) if group.finished else None  # best_of: only the n best, at the end
        return self._output(group, deltas)

    def _pool(
        self, group: SequenceGroup, items: list[tuple[int, ScheduledSeq]], result: StepResult
    ) -> PoolingOutput | None:
        """Folds the chunk's hidden states in; once the whole prompt has run, the embedding, and the sequence ends."""
        ((i, s),) = items
        seq, out, total = s.seq, s.seq.output_state, len(group.prompt_token_ids)
        end = s.start + s.num_tokens
        out.pooled = fold(out.pooled, result.pooled[i], s.start, end, total, group.pooling.config.method)
        if end < total:
            return None
        seq.finish_reason = "stop"
        self.finished.append(seq)
        assert out.pooled is not None, "the whole prompt is folded in"
        return PoolingOutput(
            request_id=group.request_id,
            embedding=finish(out.pooled, group.pooling, total),
            prompt_token_ids=group.prompt_token_ids,
            num_cached_tokens=group.num_cached_tokens,
        )

    def abort(self, group: SequenceGroup) -> RequestOutput:
        """The last output of an aborted request: every open choice ends with finish_reason "abort"."""
        p = group.params
        deltas = []
        if group.beam is None and p.num_sequences == p.n:
            for seq in group.seqs:
                if not seq.finished:
                    seq.finish_reason = "abort"
                    deltas.append(CompletionDelta(index=seq.index, text="", token_ids=[], finish_reason="abort"))
        else:
            deltas = [CompletionDelta(index=i, text="", token_ids=[], finish_reason="abort") for i in range(p.n)]
        return self._request_output(group, deltas, finished=True, generated=group.seqs)

    def _fork(self, group: SequenceGroup) -> None:
        """The first token is in: every choice goes on from the prompt on its own."""
        self.forks += group.fork_choices()

    def _extend(self, group: SequenceGroup, seq: Sequence, samples: list[Sample]) -> CompletionDelta:
        """Appends a choice's tokens of this step in order (several after a speculative step), up to the first that
        ends it: what follows a stop, or max_tokens, is dropped as it never was."""
        delta = self._append(group, seq, samples[0])
        for sample in samples[1:]:
            if seq.finished:
                break
            more = self._append(group, seq, sample)
            delta.text += more.text
            delta.token_ids += more.token_ids
            if delta.logprobs is not None:
                delta.logprobs += more.logprobs or []
            delta.finish_reason, delta.stop_reason = more.finish_reason, more.stop_reason
        return delta

    def _append(self, group: SequenceGroup, seq: Sequence, sample: Sample) -> CompletionDelta:
        p = group.sampling
        token = sample.token_id
        seq.append(token, sample.logprob)
        out = seq.output_state
        assert out.detokenizer is not None, "a sampling request's choices detokenize"
        if out.grammar is not None:
            out.grammar.accept(token)
        logprobs = None
        if p.logprobs is not None:
            logprobs = [self._position(token, sample.logprob, sample.top or [])]
            out.logprobs += logprobs
        text = ""
        if token in group.eos_token_ids and not p.ignore_eos:
            seq.finish_reason = "stop"
        elif p.stop_token_ids and token in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
            if p.include_stop_str_in_output:
                text = out.detokenizer.push([token]).text
        else:
            # As vLLM: stop strings count only once min_tokens are out (stop ids and EOS are masked until then).
            delta = out.detokenizer.push([token], check_stop=len(seq.output_token_ids) >= p.min_tokens)
            text = delta.text
            if delta.stop_string is not None:
                seq.finish_reason, seq.stop_reason = "stop", delta.stop_string
        if not seq.finished and out.stop_reader is not None and text and out.stop_reader.push(text):
            seq.finish_reason = "stop"
        if not seq.finished and out.grammar is not None and out.grammar.terminated:
            seq.finish_reason = "stop"  # the grammar ended on a stop token (one that ignore_eos kept going past)
        if not seq.finished and (len(seq.output_token_ids) == p.max_tokens or seq.num_tokens >= self.max_model_len):
            seq.finish_reason = "length"
        if seq.finished:
            text += out.detokenizer.flush()
            self.finished.append(seq)
        out.text += text
        return CompletionDelta(
            index=seq.index,
            text=text,
            token_ids=[token],
            logprobs=logprobs,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )

    def _beam_step(self, group: SequenceGroup, samples: dict[int, list[Sample]]) -> None:
        """Extends the live beams by the best candidates; a beam chosen twice forks (sharing its pages)."""
        old = group.seqs
        assert len(samples) == len(old), "beam search needs every live beam in the same step"
        assert group.beam is not None
        live = group.beam.step([[(c.token_id, c.logprob) for c in samples[s.seq_id]] for s in old])
        reused: set[int] = set()
        seqs = []
        for beam in live:
            parent = old[beam.parent]
            if beam.parent in reused:
                child = parent.fork(self.new_seq_id())
                self.forks.append((parent, child))
            else:
                reused.add(beam.parent)
                child = parent
            seqs.append(child)
        for seq, beam in zip(seqs, live, strict=True):
            seq.append(beam.token_ids[-1], beam.logprobs[-1])
            if (grammar := seq.output_state.grammar) is not None:
                grammar.accept(beam.token_ids[-1])
        self.finished += [seq for j, seq in enumerate(old) if j not in reused]
        group.seqs, group.forked = seqs, True
        if group.beam.done:
            self.finished += seqs
            group.seqs = []

    def _final(self, group: SequenceGroup) -> RequestOutput:
        """best_of and beam search: the n best choices, whole, in one output."""
        p = group.sampling
        if group.beam is not None:
            choices = [self._beam_choice(group, i, beam) for i, beam in enumerate(group.beam.best(p.n))]
            generated = sum(len(d.token_ids) for d in choices)
            return self._request_output(group, choices, finished=True, generated=generated)
        best = sorted(group.seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: p.n]
        choices = [
            CompletionDelta(
                index=i,
                text=s.output_state.text,
                token_ids=list(s.output_token_ids),
                logprobs=list(s.output_state.logprobs) if p.logprobs is not None else None,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
            )
            for i, s in enumerate(best)
        ]
        return self._request_output(group, choices, finished=True, generated=best)

    def _beam_choice(self, group: SequenceGroup, index: int, beam) -> CompletionDelta:
        p = group.sampling
        tokens = list(beam.token_ids)
        assert group.beam is not None
        stopped = bool(tokens) and tokens[-1] in group.beam.stop_token_ids
        by_stop_id = stopped and tokens[-1] in (p.stop_token_ids or ())
        shown = tokens[:-1] if stopped and not (by_stop_id and p.include_stop_str_in_output) else tokens
        detok = Detokenizer(
            tokenizer=self.tokenizer,
            skip_special_tokens=p.skip_special_tokens,
            stop=cast(list[str] | None, p.stop),  # SamplingParams turns a string into a list
            include_stop_str_in_output=p.include_stop_str_in_output,
            prompt_token_ids=group.prompt_token_ids,
        )
        delta = detok.push(shown)
        text = delta.text + detok.flush()
        reason, stop_reason = ("stop" if stopped else "length"), None
        if delta.stop_string is not None:
            reason, stop_reason = "stop", delta.stop_string
        elif by_stop_id:
            stop_reason = tokens[-1]
        logprobs = None
        if p.logprobs is not None:
            logprobs = [self._position(t, lp, []) for t, lp in zip(tokens, beam.logprobs, strict=True)]
        return CompletionDelta(
            index=index, text=text, token_ids=tokens, logprobs=logprobs, finish_reason=reason, stop_reason=stop_reason
        )

    def _output(self, group: SequenceGroup, deltas: list[CompletionDelta]) -> RequestOutput:
        return self._request_output(group, deltas, finished=group.finished, generated=group.seqs)

    def _request_output(
        self, group: SequenceGroup, deltas: list[CompletionDelta], finished: bool, generated: list[Sequence] | int
    ) -> RequestOutput:
        prompt_logprobs = None
        if group.prompt_logprobs is not None and not group.prompt_logprobs_sent:
            prompt_logprobs, group.prompt_logprobs_sent = group.prompt_logprobs, True
        if not isinstance(generated, int):
            generated = sum(len(s.output_token_ids) for s in generated)
        return RequestOutput(
            request_id=group.request_id,
            outputs=deltas,
            finished=finished,
            prompt_token_ids=group.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            num_prompt_tokens=len(group.prompt_token_ids),
            num_generated_tokens=generated,
            num_cached_tokens=group.num_cached_tokens,
        )

    def _store_prompt_logprobs(self, group: SequenceGroup, start: int, entries: list) -> None:
        prompt = group.prompt_token_ids
        assert group.prompt_logprobs is not None, "asked for a request with prompt_logprobs"
        for offset, (logprob, top) in enumerate(entries):
            pos = start + 1 + offset
            group.prompt_logprobs[pos] = self._position(prompt[pos], logprob, top)

    def _position(self, token: int, logprob: float, top: list[tuple[int, float]]) -> PositionLogprobs:
        return PositionLogprobs(
            chosen=Logprob(token, *self._piece(token), logprob),
            top=[Logprob(t, *self._piece(t), lp) for t, lp in top],
        )

    def _piece(self, token: int) -> tuple[str, bytes]:
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = (token_text(self.tokenizer, token), token_bytes(self.tokenizer, token))
        return piece

"""A chunk carrying drafts becomes one decode row per position, so verification rides on the
decode path (the native step included): every row writes its K/V before any row attends, and
row j attends to the cache up to its own position, which is causal attention over the chunk.
Row j samples as the sequence would after the drafts before it, so its token is exactly
what decoding without speculation would draw there once those drafts are accepted.

A hybrid model's rows also chain their linear layers' state: row j reads the state row
j - 1 wrote and writes its own to the chunk's spare slot j - 1 (row 0 writes the sequence's
slot), so the state after every position survives the step and the scheduler keeps the one
after the last accepted token."""

from __future__ import annotations

import dataclasses

from forklift.core.scheduler_output import ScheduledChunk


def expand_draft_rows(scheduled: list[ScheduledChunk]) -> tuple[list[ScheduledChunk], list[int]]:
    """The step's chunks with each draft-carrying chunk split into rows, and for each row the
    index of the chunk it came from. Steps without drafts come back as they are."""
    if not any(chunk.num_draft_tokens for chunk in scheduled):
        return scheduled, list(range(len(scheduled)))
    rows: list[ScheduledChunk] = []
    chunk_of: list[int] = []
    for index, chunk in enumerate(scheduled):
        if not chunk.num_draft_tokens:
            rows.append(chunk)
            chunk_of.append(index)
            continue
        sampling = chunk.sampling
        assert sampling is not None and chunk.num_new_tokens == chunk.num_draft_tokens + 1
        drafts = list(chunk.token_ids[1:])
        chained = bool(chunk.draft_state_slots)
        state_slots = [chunk.state_slot, *chunk.draft_state_slots]
        for position, token_id in enumerate(chunk.token_ids):
            row_sampling = sampling
            if position:
                outputs = [*sampling.output_token_ids, *drafts[:position]]
                grammar = sampling.grammar
                if grammar is not None:  # its mask where the drafts before this row lead
                    grammar = grammar.after(drafts[:position])
                row_sampling = dataclasses.replace(
                    sampling, output_token_ids=outputs, grammar=grammar
                )
            rows.append(
                ScheduledChunk(
                    chunk.request_id,
                    [token_id],
                    chunk.start + position,
                    chunk.block_table,
                    0,
                    state_slots[position] if chained else chunk.state_slot,
                    row_sampling,
                    group_tables=chunk.group_tables,
                    lora_slot=chunk.lora_slot,
                    state_read_slot=state_slots[position - 1] if chained and position else -1,
                )
            )
            chunk_of.append(index)
    return rows, chunk_of

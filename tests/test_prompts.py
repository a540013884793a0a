"""The short-prompt measures (transmla.evaluation.prompts) on token sequences whose answer is known."""

from transmla.evaluation import prompts

# token ids standing for what a tokenizer makes of these continuations
NUMBER_LIST = [16, 11, 220, 17, 11, 220, 18, 11, 220, 20, 11, 220, 22, 11, 220, 806, 11, 220, 1032, 11]  # "1, 2, 3, 5, 7, 11, 13,"
PHRASE_LOOP = [40, 1079, 264, 15754, 13] * 5  # "I am a developer." five times
ZEROS = [16, 13] + [15] * 22  # "1.000000..."
PROSE = list(range(100, 124))  # 24 distinct tokens


def test_loop_rate_is_seq_rep_4():
    assert prompts.loop_rate(PROSE) == 0.0
    assert prompts.loop_rate([1, 2, 3]) == 0.0  # shorter than one 4-gram
    # 25 tokens, 22 4-grams, 5 distinct
    assert abs(prompts.loop_rate(PHRASE_LOOP) - (1 - 5 / 22)) < 1e-12
    assert prompts.loop_rate([7] * 10) == 1 - 1 / 7


def test_loops_flags_phrase_loops_and_runs_not_number_lists():
    assert prompts.is_degenerate(NUMBER_LIST)  # unigram repetition > 0.5: the case the 4-gram measure exists for
    assert not prompts.loop_fields(NUMBER_LIST)["loops"]
    assert prompts.loop_fields(PHRASE_LOOP)["loops"] and prompts.is_degenerate(PHRASE_LOOP)
    assert prompts.loop_fields(ZEROS)["loops"] and prompts.is_degenerate(ZEROS)  # a run of 8: both
    assert not prompts.loop_fields(PROSE)["loops"] and not prompts.is_degenerate(PROSE)


def test_summary_counts_both_flags():
    rows = [{"nll": 1.0, "repetition": prompts.repetition(c), "degenerate": prompts.is_degenerate(c),
             **prompts.loop_fields(c)} for c in (NUMBER_LIST, PHRASE_LOOP, PROSE)]
    s = prompts.summary(rows)
    assert s["prompt_degenerate"] == 2 and s["prompt_loops"] == 1 and s["prompt_nll"] == 1.0


def test_continuations_are_plain_greedy_whatever_the_generation_config_says(tiny_model_dir):
    """An original ships generation_config.json (a repetition penalty, an n-gram ban) and its export does not:
    the case study decodes both by plain greedy search, so its rows compare the models, not their files."""
    from transmla.evaluation.prompts import PROMPTS, greedy_continuations
    from transmla.io.sources import load_model

    model, tok = load_model(str(tiny_model_dir))
    plain = greedy_continuations(model, tok, PROMPTS[:2], new_tokens=12)
    model.generation_config.repetition_penalty = 50.0
    model.generation_config.no_repeat_ngram_size = 1
    assert greedy_continuations(model, tok, PROMPTS[:2], new_tokens=12) == plain
    assert all(len(c) == 12 for c in plain)
    assert any(len(set(c)) < len(c) for c in plain), "a continuation the ban would have changed"

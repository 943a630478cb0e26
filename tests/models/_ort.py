"""ONNX Runtime GenAI (CPU) as the oracle of the model tests: its greedy tokens on a folder."""


def ort_greedy(model_dir, ids, max_new_tokens):
    """ORT GenAI's greedy continuation (token ids) of ``ids`` for ``max_new_tokens`` steps."""
    import onnxruntime_genai as og

    m = og.Model(str(model_dir))
    params = og.GeneratorParams(m)
    params.set_search_options(max_length=len(ids) + max_new_tokens, do_sample=False)
    gen = og.Generator(m, params)
    gen.append_tokens(ids)
    while not gen.is_done():
        gen.generate_next_token()
    return [int(t) for t in gen.get_sequence(0)][len(ids):]


def ort_teacher_forced(model_dir, ids, forced):
    """ORT GenAI's last-position logits, fp32 [len(forced) + 1, V]: after the prompt ``ids`` and
    after each token of ``forced`` appended in turn."""
    import numpy as np
    import onnxruntime_genai as og

    m = og.Model(str(model_dir))
    params = og.GeneratorParams(m)
    params.set_search_options(max_length=len(ids) + len(forced) + 1, do_sample=False)
    gen = og.Generator(m, params)
    gen.append_tokens(ids)
    out = [np.asarray(gen.get_logits())[0, -1].astype(np.float32)]
    for tok in forced:
        gen.append_tokens([int(tok)])
        out.append(np.asarray(gen.get_logits())[0, -1].astype(np.float32))
    return np.stack(out)

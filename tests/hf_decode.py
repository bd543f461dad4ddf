"""Helpers of the Hugging Face tests: a small random LlamaForCausalLM and teacher-forced decoding."""

import copy


def small_llama(torch, transformers, attn, dtype, device, *, layers=2, heads=8, kv_heads=2, head_dim=128,
                vocab=1000, seed=0):
    """A LlamaForCausalLM with random weights (seeded), attn_implementation ``attn``."""
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=heads * head_dim,
                                   intermediate_size=2 * heads * head_dim, num_hidden_layers=layers,
                                   num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                                   max_position_embeddings=4096)
    torch.manual_seed(seed)
    try:
        model = transformers.LlamaForCausalLM._from_config(copy.deepcopy(cfg), attn_implementation=attn)
    except ValueError:  # a transformers that checks names against a fixed list: switch after building
        import fdpp.integrations.hf as fdpp_hf

        model = transformers.LlamaForCausalLM._from_config(copy.deepcopy(cfg), attn_implementation="sdpa")
        fdpp_hf.use_fdpp(model, attn)
    return model.to(device=device, dtype=dtype).eval()


def decode(torch, model, prompt, steps, attention_mask=None, tokens=None):
    """Prefill ``prompt`` [B, T], then ``steps`` decode steps; step i feeds ``tokens[:, i]`` when
    given (teacher forcing), else the greedy token. Returns (logits [steps + 1, B, V] float32 of
    the prefill's last position and of every step, fed tokens [B, steps])."""
    out = model(prompt, attention_mask=attention_mask, use_cache=True)
    cache, logits, fed = out.past_key_values, [out.logits[:, -1].float()], []
    for i in range(steps):
        tok = tokens[:, i:i + 1] if tokens is not None else logits[-1].argmax(-1, keepdim=True)
        if attention_mask is not None:
            attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], dim=1)
        out = model(tok, past_key_values=cache, attention_mask=attention_mask, use_cache=True)
        cache = out.past_key_values
        logits.append(out.logits[:, -1].float())
        fed.append(tok)
    return torch.stack(logits), torch.cat(fed, dim=1)

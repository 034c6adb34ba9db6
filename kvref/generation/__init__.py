"""Generation over a model: what to select (sampling, speculative decoding) and when to stop, one
sequence at a time (generate, conversation) or many at once (batch: the scheduler and the engine).

    config.py        GenerationConfig: the settings, the model's defaults, their checks
    sampling.py      logits -> a token id (greedy, temperature, top-k/top-p/min-p, penalties)
    speculative.py   prompt lookup drafts and their verification budget
    stream.py        TextStream: token ids in, text out, cut at stop strings
    grammar.py       structured output: a JSON schema or grammar masks the logits (llguidance)
    generate.py      kvref.generate and kvref.resume: the decode loop on one cache
    conversation.py  Conversation: a chat kept on one cache, turn by turn
    batch.py         several sequences: forward_batch, the Scheduler that plans and the Engine that runs
"""

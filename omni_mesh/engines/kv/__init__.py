"""Moving a prompt's state engine to engine for a split stage (deploy ``prefill:``): NIXL agents
and their pacing (:mod:`.nixl_agents`), the hold and receive buffers and their peers
(:mod:`.exchange`, slots from :mod:`.arena`), one pull (:mod:`.pull`), the params' format
(:mod:`.params`) and the counters every engine reports (:mod:`.counts`). vLLM's own connector
uses the agents' pacing and the counters; the transformers engines use all of it.
"""

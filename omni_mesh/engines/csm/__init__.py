"""CSM text to speech on ``transformers``: the talker (backbone + depth decoder; :mod:`.talker`,
batched by :mod:`.talker_batch`) → the Mimi decoder (:mod:`.code2wav`); :mod:`.processors` hands
the codes on, :mod:`.tiny` builds ``tiny-csm`` offline from the real config classes.
"""

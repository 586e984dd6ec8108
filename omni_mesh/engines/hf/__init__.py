"""Loading the model families' stages from Hugging Face folders (shared by every family that runs
on ``transformers``): :mod:`.folders` resolves a stage's ``model`` (a tiny registered name, built
offline on first use, or a folder), :mod:`.common` loads a stage's own part of it on its devices,
:mod:`.tokenizer` trains the tiny folders' tokenizers offline, :mod:`.codes` carries codec frames
between a talker and its code2wav.
"""

"""The Hugging Face checkpoint format, read: what a model folder's ``config.json`` and
safetensors files mean to a GPT.

A private package (``wb.hf.hf_config``, ``wb.hf.HFSource``, ``wb.hf.CheckpointError`` and
``wb.hf.HFConfigError`` are its public names): ``families`` (``config.json`` ->
``GPTConfig``, per family) -> ``config`` (``hf_config`` of a folder or Hub id,
``check_matches``); ``tensors`` (which HF tensors make each parameter; sliced safetensors
reads) and ``vocab`` (a tokenizer's ids against the vocabulary) -> ``load``
(``load_params``: a folder's weights into given shardings; ``check_weights``).

It sits below ``train``, whose ``init=`` and ``TrainConfig.check`` read a folder through
it, and above ``models`` and ``_hub`` (Hub ids); ``workbench.hf`` (``from_hf``, ``to_hf``,
``export_run``) builds on it, writing the same format. Importing it imports none of its
modules.
"""

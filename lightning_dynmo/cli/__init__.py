"""What the Hydra recipes (``recipes/train_gpt.py``) build from their config tree (``conf/``):
the ``dynamism`` group's model class and callbacks (``dynamism``), ``model=hf`` (``hf_model``)
and multirun children under Lightning's launcher (``multirun``). Library code, so the recipes
stay entry points; nothing else in the package imports it."""

"""``remat.integrations``: remat inside the training loops users already run.

One module per framework, each imported only when used (``import remat`` imports neither
transformers nor lightning): ``remat.integrations.transformers.RematCallback`` for Hugging
Face ``Trainer``, ``remat.integrations.lightning.RematCallback`` for PyTorch Lightning.
Accelerate and plain loops need no callback: ``remat.auto(model, batch, budget)`` takes the
batch dict the loop yields (``examples/accelerate_loop.py``). ``_first_batch`` holds what the
callbacks share: plan on the first real batch, log the plan, write it next to the run's output.
"""

__all__: list[str] = []

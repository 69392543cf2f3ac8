"""`fp8lab.integrations`: fp8lab inside other people's training loops (docs/integrations.md).

* `fp8lab.integrations.hf.FP8LabCallback` -- a transformers ``TrainerCallback``
  (``pip install fp8lab[hf]``);
* `fp8lab.integrations.lightning.FP8LabCallback` -- a Lightning ``Callback``
  (``pip install fp8lab[lightning]``);
* `fp8lab.integrations.accelerate.check_prepared` -- refuses a converted model that accelerate's
  ``mixed_precision="fp8"`` took over.

Each callback gives the lab's watch records, the lab's anomaly guard (skip / rollback /
escalation, `fp8lab.guard.session`) and the FP8 state in the framework's checkpoints. The
framework modules import their framework, so they are not imported here.

Layer: beside ``lab`` (it imports ``guard``, ``observe``, ``nn`` and ``optim``, never ``lab``).
"""

from fp8lab.integrations.accelerate import check_prepared

__all__ = ["check_prepared"]

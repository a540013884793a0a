"""The conversion pipeline as steps: typed values in, typed (serialisable) values out.

    CalibrationStats / LayerMoments       method.calibration     (statistics of the attention input)
    budget   = resolve_budget(spec, o)    pipeline.budget        (RoPE plan + kv_lora_rank)
    per layer:
      rot    = rotation_step(...)         pipeline.rotation      -> method.rorope.KeyRotation
      basis  = basis_step(...)            pipeline.basis         -> method.bkv.JointBasis
      layer  = layer_step(...)            pipeline.layer         -> method.mla.MLALayer
    config, state dict = assemble(...)    pipeline.assemble      -> io.export.write_checkpoint

Every value has to_tensors/from_tensors, every step is a pure function of (layer weights, moments,
options), and each step lives in its own module so a cache keyed on the code a step runs (tasks/)
is invalidated by exactly the modules that step imports. `transmla.convert` runs the steps in
memory; the Prefect tasks run the same functions one at a time. This file imports nothing.
"""

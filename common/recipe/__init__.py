"""The recipe: what is trained and how, the same in every training script.

    models      image classifiers built by name (ours, torchvision:NAME, timm:NAME)
    optim       the optimizer (SGD with Nesterov momentum, AdamW; the head's own lr) and the
                learning-rate schedule (one-cycle or step decay), stepped once per optimizer step
    numerics    how fp32 math runs (TF32, cuDNN's search, determinism), and a CPU's freed
                memory kept for reuse (AMP's 16-bit format is train_amp.py's: parallel/amp)
    compiling   torch.compile of the model (--compile) through Accelerate's dynamo plugin
    ema         weight averaging (--ema-decay): updated every step, evaluated, and written as
                model.safetensors
    evaluation  exact test accuracy, overall and per class, however many processes share it
"""

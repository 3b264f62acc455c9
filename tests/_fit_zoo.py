"""The zoo sizes of the fit tests (tests/planning/test_fit.py), also ``benchmarks/fit.py --quick``'s."""

#: Small zoo models (a step in well under a second on 2 CPU cores), with the zoo's dropout where it has one.
ZOO = {
    "gpt2": {"layers": 3, "hidden": 64, "heads": 4, "vocab": 512, "seq": 64, "batch": 2},
    "llama": {
        "layers": 3,
        "hidden": 64,
        "intermediate": 172,
        "heads": 4,
        "kv_heads": 2,
        "vocab": 512,
        "seq": 64,
        "batch": 2,
    },
    # ViT and ResNet with activations well above their parameters, so that 0.6 of the step is above the lowest
    # peak any plan reaches (a ResNet block under full keeps its input, half of what it keeps without checkpointing)
    "vit": {
        "layers": 3,
        "hidden": 32,
        "intermediate": 64,
        "heads": 2,
        "image": 64,
        "patch": 8,
        "classes": 10,
        "batch": 2,
        "dropout": 0.1,
    },
    "resnet50": {
        "depths": (3, 3),
        "hidden_sizes": (32, 32),
        "embedding_size": 4,
        "image": 32,
        "classes": 10,
        "batch": 8,
    },
}

"""`python -m meshrl.models`: make sure the embedded model's HF folder is converted and cached."""

from meshrl.runtime import configure_environment

if __name__ == "__main__":
    configure_environment()
    from meshrl.models.embedded import smollm2_hf_dir

    print(f"embedded model: {smollm2_hf_dir()}")

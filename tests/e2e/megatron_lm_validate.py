"""Run Megatron-LM's parse_args + validate_args (with megatron_vshape.install()) once per case, in one
process, and print one JSON line per case: "ok", the ConfigError's message, or Megatron-LM's own refusal.

    python megatron_lm_validate.py CHECKOUT '[["--flag", ...], ...]'

CHECKOUT is a Megatron-LM checkout or the stand-in; its `megatron.training` is the one hooked.  Nothing
here creates a process group: these are the checks made before any exists (WORLD_SIZE/RANK from env).
"""
import json
import sys


def main(root: str, cases: list) -> None:
    sys.path.insert(0, root)
    import megatron_vshape

    megatron_vshape.install()
    from megatron.training import arguments as initialize  # where every release looks them up

    from megatron_vshape.schedule.errors import ConfigError

    for argv in cases:
        sys.argv = ["pretrain_gpt.py", *argv]
        try:
            initialize.validate_args(initialize.parse_args())
            result = "ok"
        except ConfigError as e:
            result = str(e)
        except AssertionError as e:  # Megatron-LM's own validation
            result = f"Megatron-LM refused: {e}"
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))

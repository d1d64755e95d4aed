"""python -m vllm_deepinfer.checkpoint --out DIR [--quantized] [--vision]"""
import argparse

from vllm_deepinfer.checkpoint.tiny import write_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description="Write the embedded tiny V4.1-Flash checkpoint.")
    parser.add_argument("--out", required=True, help="directory to write")
    parser.add_argument("--quantized", action="store_true",
                        help="MXFP8 linears and MXFP4 experts, as in the release")
    parser.add_argument("--vision", action="store_true",
                        help="the vision-language variant: vision tower and bias_vl, as in "
                             "the release")
    args = parser.parse_args()
    print(write_checkpoint(args.out, quantized=args.quantized, vision=args.vision))


if __name__ == "__main__":
    main()

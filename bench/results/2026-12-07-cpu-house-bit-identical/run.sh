#!/usr/bin/env bash
# $1: cpfill binary, $2: out dir
set -e
B=$1; O=$2; mkdir -p $O
MP="mpirun --allow-run-as-root --oversubscribe -x OMPI_MCA_pml=ob1 -x OMPI_MCA_btl_vader_single_copy_mechanism=none"
$MP -np 4 $B prefill --model tiny --tp 2 --prompt-lens 100,37,250 --save-logits $O/prefill.safetensors --threads 1 > $O/prefill.txt 2>&1
$MP -np 4 $B prefill --model tiny --tp 2 --ranks-per-node 2 --algo pass-q --prompt-lens 300,64 --save-logits $O/passq.safetensors --threads 1 > $O/passq.txt 2>&1
$MP -np 4 $B generate --model tiny --tp 2 --prompt-lens 40,77,13 --max-tokens 24 --json $O/gen.json --threads 1 > $O/gen.txt 2>&1
$MP -np 4 $B generate --model tiny --tp 1 --prompt-lens 40,77 --max-tokens 16 --temperature 0.8 --sample-seed 3 --json $O/gen2.json --threads 1 > $O/gen2.txt 2>&1 || true

#!/usr/bin/env bash
# On the GPU machine: where a prompt's time goes, op by op, on the GLM-5-shaped slices
# (bf16, int4 experts): `strata-bench decode --profile` waits for the device after each op
# of the prompt's forward, so an op's time is its kernels plus the host work around them,
# and what no op accounts for is the host's alone. Each prompt length in PROMPTS (default
# "64 512"), each variant in VARIANTS (`_` the defaults; STRATA_X=v[,STRATA_Y=w] in the
# environment; --flag=value[,--other=value] added to the command; BIN=NAME another carried
# binary, .devcarry/NAME[.xz]), REPS times, each slice
# in SLICES ("bf16 int4-g64"), also timed without --profile. Binaries in .devcarry/ (see
# env.sh). Writes $OUT/prompt-profile.jsonl and $OUT/side.log.
set -uo pipefail
. "$(dirname "$0")/env.sh"
S=$C/strata
slice=/tmp/slice48
glm5_slice $slice
res="$OUT/prompt-profile.jsonl"
for rep in $(seq 1 ${REPS:-1}); do
  for u in ${VARIANTS:-_}; do
    setenv=(); flags=(); bin=$S
    case $u in
      _) ;;
      --*) flags=(${u//,/ }) ;;
      BIN=*) bin=$(carried_bin "${u#BIN=}") || exit 1 ;;
      *) setenv=(${u//,/ }) ;;
    esac
    for p in ${PROMPTS:-64 512}; do
      for d in "$slice bf16" "$slice-int4 int4-g64"; do
        set -- $d
        [[ " ${SLICES:-bf16 int4-g64} " == *" $2 "* ]] || continue
        for prof in "" --profile; do
          since "$2 $p $u $prof"
          env "${setenv[@]}" timeout 120 $bin bench decode --model "$1" --device cuda --prompt-tokens $p --decode-tokens 8 \
            --warmup --usage off --mtp off --json $prof "${flags[@]}" 2>>"$OUT/side.log" | python3 -c "
import json,sys; r=json.load(sys.stdin)
o={'weights':'$2','variant':'$u','prompt':$p,'profile':'$prof'!='','prefill_tps':round(r['prefill_tokens_per_s'],1),
   'prefill_ms':round($p/r['prefill_tokens_per_s']*1e3,3)}
if 'profile_prefill_ms' in r:
    o['ops_ms']={k.split(' (')[0]:round(v['ms'],3) for k,v in r['profile_prefill_ms'].items()}
    o['unaccounted_ms']=round(r['profile_prefill_unaccounted_ms'],3)
print(json.dumps(o))" | tee -a "$res"
        done
      done
    done
  done
done

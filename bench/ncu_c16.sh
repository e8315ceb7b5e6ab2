#!/usr/bin/env bash
# Nsight Compute on the 16-token inference flow's two kernels (one window of a B=1 H=32 T=64K prefill): launch and
# occupancy figures, stall-reason samples, and the stall samples per Triton source line (bench/ncu_lines.py).
# On the GPU machine, from the repository root:  OUT=/some/dir bash bench/ncu_c16.sh [--c16-mode N]
# KERNELS names the profiled kernels to report (default: the Triton prep and the state pass; the Gluon prep is
# _c16_prep_gluon). Also printed: shared-memory wavefronts and bank conflicts per kernel.
set -x
R=$OUT/c16
ncu --clock-control none --profile-from-start off --set full --import-source yes --kernel-name regex:"_c16_" --launch-count 2 --export $R --force-overwrite python bench/ncu_kda.py --case prefill16 "$@" > $OUT/ncu_run.log 2>&1
tail -3 $OUT/ncu_run.log
for k in ${KERNELS:-_c16_prep _c16_state}; do
  ncu -i $R.ncu-rep --kernel-name $k --page details --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats --section LaunchStats --section MemoryWorkloadAnalysis 2>&1 | grep -v "^    ---\|^$" | grep -E "Duration|Throughput|Registers|Achieved Occupancy|Theoretical Occupancy|Warp Cycles Per Issued|Issued Warp|No Eligible|Active Warps|Eligible Warps|Block Limit|Shared Memory Config|Dynamic Shared|Stall|L1/TEX Hit|L2 Hit|DRAM Through|Compute \(SM\)|Memory Throughput" | head -40
  ncu -i $R.ncu-rep --kernel-name $k --page raw --csv --metrics smsp__pcsamp_warps_issue_stalled_barrier,smsp__pcsamp_warps_issue_stalled_long_scoreboard,smsp__pcsamp_warps_issue_stalled_short_scoreboard,smsp__pcsamp_warps_issue_stalled_wait,smsp__pcsamp_warps_issue_stalled_math_pipe_throttle,smsp__pcsamp_warps_issue_stalled_mio_throttle,smsp__pcsamp_warps_issue_stalled_lg_throttle,smsp__pcsamp_warps_issue_stalled_selected,smsp__pcsamp_warps_issue_stalled_not_selected,smsp__pcsamp_warps_issue_stalled_membar,smsp__pcsamp_warps_issue_stalled_dispatch_stall,smsp__pcsamp_warps_issue_stalled_sleeping,smsp__pcsamp_warps_issue_stalled_branch_resolving,smsp__pcsamp_warps_issue_stalled_no_instructions,smsp__pcsamp_warps_issue_stalled_imc_miss,smsp__pcsamp_warps_issue_stalled_drain,smsp__pcsamp_warps_issue_stalled_tex_throttle,smsp__pcsamp_warps_issue_stalled_misc,smsp__pcsamp_sample_count 2>&1 | tail -3
  ncu -i $R.ncu-rep --kernel-name $k --page raw --csv --metrics smsp__inst_executed.sum,sm__cycles_elapsed.avg,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,smsp__sass_inst_executed_op_shared_ld.sum,smsp__sass_inst_executed_op_shared_st.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,sm__pipe_shared_cycles_active.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts.avg.pct_of_peak_sustained_elapsed 2>&1 | tail -3
  ncu -i $R.ncu-rep --page source --csv --print-source sass --kernel-name $k > $OUT/$k.csv 2>/dev/null
  python bench/ncu_lines.py $OUT/$k.csv $k --top 30 2>&1 | tail -80
done

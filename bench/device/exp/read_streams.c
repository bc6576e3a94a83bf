// Run by hand on any AVX2 host: gcc -O2 -mavx2 -mfma -pthread bench/device/exp/read_streams.c -o rs && ./rs
// Read bandwidth by threads (T = 1, 2) x independent sequential streams per thread (S = 1..8), with and without a
// bf16-widening FMA per loaded vector: does a kernel with 2 row streams per thread leave DRAM bandwidth unused?
// On the 2-vCPU Zen 3 dev VM, 2 threads with compute, S = 4-8 reads +15-25% over S = 1-2 (16.9-19.6 against
// 14.8-16.2 GB/s): the lead for the bf16 / fp4 row kernels (issue 3).
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
typedef struct { const char* p; size_t n; int S; long long sink; int compute; } Arg;
static void* run(void* v){ Arg* a=v; __m256i acc[8]; for(int i=0;i<8;i++) acc[i]=_mm256_setzero_si256();
  __m256 f[8]; for(int i=0;i<8;i++) f[i]=_mm256_setzero_ps();
  size_t q=a->n/a->S/128*128;
  for(size_t i=0;i<q;i+=128) for(int s=0;s<a->S;s++){ const char* p=a->p+s*q+i;
    for(int k=0;k<4;k++){ __m256i x=_mm256_load_si256((const __m256i*)(p+32*k));
      if(a->compute){ __m256 lo=_mm256_castsi256_ps(_mm256_slli_epi32(x,16)); __m256 hi=_mm256_castsi256_ps(_mm256_and_si256(x,_mm256_set1_epi32(0xFFFF0000)));
        f[k]=_mm256_fmadd_ps(lo,lo,f[k]); f[k+4]=_mm256_fmadd_ps(hi,hi,f[k+4]);}
      else acc[k]=_mm256_add_epi64(acc[k],x);} }
  long long s=0; for(int i=0;i<8;i++) s+=_mm256_extract_epi64(acc[i],0)+(long long)f[i][0]; a->sink=s; return 0;}
int main(int c,char**v){ size_t N=256u<<20; char* b=aligned_alloc(64,N); memset(b,1,N);
  for(int rep=0;rep<3;rep++) for(int comp=0;comp<2;comp++) for(int T=1;T<=2;T++) for(int S=1;S<=8;S*=2){
    pthread_t th[2]; Arg a[2]; double t=now();
    for(int i=0;i<T;i++){ a[i].p=b+i*(N/T); a[i].n=N/T; a[i].S=S; a[i].compute=comp; pthread_create(&th[i],0,run,&a[i]);}
    for(int i=0;i<T;i++) pthread_join(th[i],0); double dt=now()-t;
    printf("rep %d compute %d T=%d S=%d: %.1f GB/s\n",rep,comp,T,S,N/dt/1e9);}
}

#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
__attribute__((noinline)) int first_max(const float*row,int n){float v=row[0];int best=0;for(int c=1;c<n;c++){if(row[c]>v){v=row[c];best=c;}}return best;}
__attribute__((noinline)) int first_max2(const float*row,int n){
  /* max value by a branch-free reduction (vectorizable), then the first index holding it */
  float m[8]; for(int k=0;k<8;k++) m[k]=row[0];
  int c=0; for(;c+8<=n;c+=8){for(int k=0;k<8;k++){float x=row[c+k]; m[k]= x>m[k]?x:m[k];}}
  float v=m[0]; for(int k=1;k<8;k++) v= m[k]>v?m[k]:v;
  for(;c<n;c++) v= row[c]>v?row[c]:v;
  for(int i=0;i<n;i++) if(row[i]==v) return i;
  return 0;}
int main(){int n=151936;float*r=malloc(n*4);srand(1);for(int i=0;i<n;i++)r[i]=(float)rand()/RAND_MAX;
 volatile int s=0;for(int rep=0;rep<3;rep++){double t=now();for(int i=0;i<200;i++)s+=first_max(r,n);double a=(now()-t)/200;
 t=now();for(int i=0;i<200;i++)s+=first_max2(r,n);double b=(now()-t)/200;printf("loop %.1f us, two-pass %.1f us (%d %d)\n",a*1e6,b*1e6,first_max(r,n),first_max2(r,n));}}

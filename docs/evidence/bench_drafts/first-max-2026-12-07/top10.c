#include <stdio.h>
#include <stdlib.h>
#include <math.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
/* draft_top_p before the change: every element through the top-10 insertion */
__attribute__((noinline)) float top_p(const float*row,int n){float top[10];int m=0,j;float v,s=0;
 for(int i=0;i<n;i++){v=row[i]; if(m<10){j=m;m++;} else if(v>top[9]) j=9; else continue;
  while(j>0&&top[j-1]<v){top[j]=top[j-1];j--;} top[j]=v;}
 for(int i=0;i<m;i++) s+=expf(top[i]-top[0]); return 1.0f/s;}
int main(int argc,char**argv){int n=argc>1?atoi(argv[1]):151936;float*r=malloc(n*4);srand(1);for(int i=0;i<n;i++)r[i]=(float)rand()/RAND_MAX;
 volatile float s=0;for(int rep=0;rep<3;rep++){double t=now();for(int i=0;i<200;i++)s+=top_p(r,n);printf("scalar top-10 %.1f us\n",(now()-t)/200*1e6);}}

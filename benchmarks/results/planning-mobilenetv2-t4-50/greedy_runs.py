import re, sys
for f in sys.argv[1:]:
    runs=[];cur=None
    for line in open(f):
        m=re.search(r"^\s*(\d+) greedy step (\d+): peak (\d+) \(goal (\d+)\), (\d+) decisions",line)
        if m:
            t,st,pk,g,d=map(int,m.groups())
            if st==0 or cur is None: cur=[];runs.append(cur)
            cur.append((t,pk,g,d))
        elif "greedy" not in line:
            cur=None; runs.append(line[:200])
    for r in runs:
        if isinstance(r,str): print(r.strip()); continue
        print(f.split('/')[-1], "goal",r[0][2],"steps",len(r),"peak %d->%d"%(r[0][1],r[-1][1]),"decisions",r[-1][3],"secs %.0f"%((r[-1][0]-r[0][0])/1000), "end %.0f"%(r[-1][0]/1000))

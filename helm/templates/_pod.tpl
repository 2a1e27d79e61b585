{{/*
The pod every replica runs (and, for replicas spanning nodes, every LeaderWorkerSet member runs).
Call with (dict "root" $ "role" "single|leader|worker").
*/}}
{{- define "specdec.podSpec" -}}
{{- $ := .root -}}
{{- $role := .role -}}
{{- $v := $.Values -}}
{{- $gpu := eq (include "specdec.gpuBackend" $) "true" -}}
{{- $gpus := int (include "specdec.gpusPerPod" $) -}}
{{- $multi := eq (include "specdec.multiNode" $) "true" -}}
{{- $paths := include "specdec.healthPaths" $ | fromJson -}}
{{- $engine := include "specdec.enginePath" $ -}}
{{- $build := eq $v.engine.source "build" -}}
serviceAccountName: {{ include "specdec.serviceAccountName" $ }}
terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
{{- with $v.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with $v.imagePullSecrets }}
imagePullSecrets: {{- toYaml . | nindent 2 }}
{{- end }}
{{- if $v.runtimeClassName }}
runtimeClassName: {{ $v.runtimeClassName }}
{{- end }}
securityContext: {{- toYaml $v.podSecurityContext | nindent 2 }}
{{- $selector := $v.nodeSelector }}
{{- if $gpu }}{{- $selector = merge (dict "nvidia.com/gpu.product" $v.gpu.product) $v.nodeSelector }}{{- end }}
{{- with $selector }}
nodeSelector: {{- toYaml . | nindent 2 }}
{{- end }}
{{- $tolerations := $v.tolerations }}
{{- if and $gpu $v.gpu.tolerate }}{{- $tolerations = append $v.tolerations (dict "key" $v.gpu.resourceName "operator" "Exists" "effect" "NoSchedule") }}{{- end }}
{{- with $tolerations }}
tolerations: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.affinity }}
affinity: {{- toYaml . | nindent 2 }}
{{- end }}
{{- if and $v.topologySpread.enabled (ne $role "worker") (or (gt (int $v.replicaCount) 1) $v.autoscaling.enabled) }}
topologySpreadConstraints:
  - maxSkew: 1
    topologyKey: {{ $v.topologySpread.topologyKey }}
    whenUnsatisfiable: {{ $v.topologySpread.whenUnsatisfiable }}
    labelSelector:
      matchLabels: {{- include "specdec.selectorLabels" $ | nindent 8 }}
{{- end }}
{{- if $build }}
initContainers:
  {{- include "specdec.waitForEngine" $ | nindent 2 }}
{{- end }}
containers:
  - name: server
    image: {{ include "specdec.image" $ }}
    imagePullPolicy: {{ $v.imagePullPolicy }}
    command: ["specdec-serve"]
    args:
      - --engine={{ $engine }}
      - --host=0.0.0.0
      - --port={{ $v.server.port }}
      - --served-model-name={{ include "specdec.servedModelName" $ }}
      {{- if not $gpu }}
      - --max-num-seqs={{ $v.server.maxNumSeqs }}
      - --max-queue={{ $v.server.maxQueue }}
      - --speculation={{ $v.server.speculation }}
      {{- if and (hasKey $v.server "joinedVocab") (not $v.server.joinedVocab) }}
      - --joined-vocab=off
      {{- end }}
      - --drain-timeout={{ $v.server.drainTimeoutSeconds }}
      {{- end }}
      {{- if or $multi $v.server.extraArgs }}
      - "--"
      {{- end }}
      {{- if and $multi (eq $v.backend "vllm") }}
      - --nnodes={{ include "specdec.nodesPerReplica" $ }}
      - --node-rank=$(LWS_WORKER_INDEX)
      - --master-addr=$(LWS_LEADER_ADDRESS)
      - --master-port=29500
      {{- if eq $role "worker" }}
      - --headless
      {{- end }}
      {{- else if $multi }}
      - --nnodes={{ include "specdec.nodesPerReplica" $ }}
      - --node-rank=$(LWS_WORKER_INDEX)
      - --dist-init-addr=$(LWS_LEADER_ADDRESS):20000
      {{- end }}
      {{- range $v.server.extraArgs }}
      - {{ . | quote }}
      {{- end }}
    env:
      - {name: HOME, value: /tmp}
      {{- if $v.apiKey.existingSecret }}
      - name: SPECDEC_API_KEY
        valueFrom: {secretKeyRef: {name: {{ $v.apiKey.existingSecret }}, key: {{ $v.apiKey.key }}}}
      {{- end }}
      {{- with $v.server.env }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
      {{- if $multi }}
      {{- with $v.multiNode.env }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
      {{- end }}
    {{- with $v.server.envFrom }}
    envFrom: {{- toYaml . | nindent 6 }}
    {{- end }}
    ports:
      - {name: http, containerPort: {{ $v.server.port }}, protocol: TCP}
    {{- if ne $role "worker" }}
    startupProbe:
      httpGet: {path: {{ $paths.live }}, port: http}
      periodSeconds: {{ $v.probes.startup.periodSeconds }}
      failureThreshold: {{ $v.probes.startup.failureThreshold }}
    livenessProbe:
      httpGet: {path: {{ $paths.live }}, port: http}
      periodSeconds: {{ $v.probes.liveness.periodSeconds }}
      timeoutSeconds: {{ $v.probes.liveness.timeoutSeconds }}
      failureThreshold: {{ $v.probes.liveness.failureThreshold }}
    readinessProbe:
      httpGet: {path: {{ $paths.ready }}, port: http}
      periodSeconds: {{ $v.probes.readiness.periodSeconds }}
      timeoutSeconds: {{ $v.probes.readiness.timeoutSeconds }}
      failureThreshold: {{ $v.probes.readiness.failureThreshold }}
    {{- end }}
    lifecycle:
      preStop:
        exec: {command: ["sleep", "{{ $v.preStopSleepSeconds }}"]}
    {{- $rdma := and $multi $v.multiNode.rdma.enabled }}
    {{- if $rdma }}
    {{- /* RDMA verbs pin their buffers in memory: IPC_LOCK, the one capability added to what is dropped */}}
    securityContext: {{- toYaml (merge (dict "capabilities" (dict "drop" (list "ALL") "add" (list "IPC_LOCK"))) (omit $v.securityContext "capabilities")) | nindent 6 }}
    {{- else }}
    securityContext: {{- toYaml $v.securityContext | nindent 6 }}
    {{- end }}
    resources:
      {{- if $gpu }}
      {{- $devices := dict $v.gpu.resourceName $gpus }}
      {{- if $rdma }}{{- $_ := set $devices $v.multiNode.rdma.resourceName (int $v.multiNode.rdma.count) }}{{- end }}
      requests: {{- toYaml (merge (deepCopy $devices) $v.gpuResources.requests) | nindent 8 }}
      limits: {{- toYaml (merge (deepCopy $devices) $v.gpuResources.limits) | nindent 8 }}
      {{- else }}
      {{- toYaml $v.resources | nindent 6 }}
      {{- end }}
    volumeMounts:
      - {name: tmp, mountPath: /tmp}
      {{- if or $build (and (eq $v.engine.source "prebuilt") $v.engine.cache.existingClaim) }}
      - {name: engine-cache, mountPath: /engine-cache, readOnly: true}
      {{- end }}
      {{- if gt (int (include "specdec.gpusPerReplica" $)) 1 }}
      - {name: shm, mountPath: /dev/shm}
      {{- end }}
      {{- with $v.extraVolumeMounts }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
volumes:
  - name: tmp
    emptyDir: {}
  {{- if or $build (and (eq $v.engine.source "prebuilt") $v.engine.cache.existingClaim) }}
  - name: engine-cache
    persistentVolumeClaim: {claimName: {{ include "specdec.engineClaim" $ }}}
  {{- end }}
  {{- if gt (int (include "specdec.gpusPerReplica" $)) 1 }}
  - name: shm
    emptyDir: {medium: Memory, sizeLimit: {{ $v.shm.sizeLimit }}}
  {{- end }}
  {{- with $v.extraVolumes }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end -}}

{{/* Serving pods start once the build Job has put the engine's manifest in place (the builder writes it last). If the
     build failed, the Job leaves its last lines in <engine>.failed: the pod's init container fails with them (and is
     retried, so a later successful build is picked up). */}}
{{- define "specdec.waitForEngine" -}}
{{- $v := .Values -}}
- name: wait-for-engine
  image: {{ include "specdec.image" . }}
  imagePullPolicy: {{ $v.imagePullPolicy }}
  command:
    - sh
    - -c
    - |
      until [ -f "$ENGINE/manifest.json" ]; do
        if [ -f "$ENGINE.failed" ]; then
          echo "the engine build failed (kubectl logs job/$JOB); its last lines:" >&2
          cat "$ENGINE.failed" >&2
          exit 1
        fi
        echo "waiting for job/$JOB to build $ENGINE"
        sleep 10
      done
  env:
    - {name: ENGINE, value: {{ include "specdec.enginePath" . | quote }}}
    - {name: JOB, value: {{ include "specdec.buildJobName" . | quote }}}
  securityContext: {{- toYaml $v.securityContext | nindent 4 }}
  resources:
    requests: {cpu: 10m, memory: 32Mi}
    limits: {memory: 64Mi}
  volumeMounts:
    - {name: engine-cache, mountPath: /engine-cache, readOnly: true}
{{- end -}}

{{/* The engine build, once per release: download the checkpoints into the model cache (Hugging Face, S3; a PVC is
     read in place), then build into the engine cache. It runs on a CPU node by default (engine.build.nodeSelector):
     the builder converts checkpoints and needs no GPU, and a build asking for the GPUs that the waiting serving pods
     already hold would never be scheduled. */}}
{{- define "specdec.buildPodSpec" -}}
{{- $v := .Values -}}
{{- $m := $v.model -}}
{{- $paths := include "specdec.modelPaths" . | fromJson -}}
{{- $engine := include "specdec.enginePath" . -}}
serviceAccountName: {{ include "specdec.serviceAccountName" . }}
restartPolicy: Never
{{- with $v.imagePullSecrets }}
imagePullSecrets: {{- toYaml . | nindent 2 }}
{{- end }}
securityContext: {{- toYaml $v.podSecurityContext | nindent 2 }}
{{- with $v.engine.build.nodeSelector }}
nodeSelector: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.engine.build.tolerations }}
tolerations: {{- toYaml . | nindent 2 }}
{{- end }}
{{- if ne $m.source "pvc" }}
initContainers:
  {{- if eq $m.source "huggingface" }}
  - name: fetch-models
    image: {{ include "specdec.image" . }}
    imagePullPolicy: {{ $v.imagePullPolicy }}
    command: ["python", "-c"]
    args:
      - |
        import os
        from huggingface_hub import snapshot_download
        for repo, where in ((os.environ["TARGET"], os.environ["TARGET_DIR"]), (os.environ["DRAFT"], os.environ["DRAFT_DIR"])):
            if not repo:  # a model-free draft has no checkpoint
                continue
            done = os.path.join(where, ".specdec-complete")
            if os.path.isfile(done):
                print(f"{repo}: cached in {where}")
                continue
            # the checkpoint the builder reads, not a repository's other copies (Meta's original/*.pth: as large again)
            snapshot_download(repo, local_dir=where, token=os.environ.get("HF_TOKEN") or None, ignore_patterns=["original/*", "*.pth"])
            open(done, "w").close()
    env:
      - {name: TARGET, value: {{ $m.huggingface.target | quote }}}
      - {name: DRAFT, value: {{ ternary $m.huggingface.draft "" (eq (include "specdec.hasHead" .) "true") | quote }}}
      - {name: TARGET_DIR, value: {{ $paths.target | quote }}}
      - {name: DRAFT_DIR, value: {{ $paths.draft | quote }}}
      - {name: HOME, value: /tmp}
      {{- if $m.huggingface.tokenSecret.name }}
      - name: HF_TOKEN
        valueFrom: {secretKeyRef: {name: {{ $m.huggingface.tokenSecret.name }}, key: {{ $m.huggingface.tokenSecret.key }}}}
      {{- end }}
    securityContext: {{- toYaml $v.securityContext | nindent 6 }}
    volumeMounts:
      - {name: models, mountPath: /models}
      - {name: tmp, mountPath: /tmp}
  {{- else }}
  - name: fetch-models
    image: {{ printf "%s:%s" $v.images.s3.repository $v.images.s3.tag }}
    imagePullPolicy: {{ $v.imagePullPolicy }}
    command: ["sh", "-c", "aws s3 sync \"$TARGET\" \"$TARGET_DIR\" && { [ -z \"$DRAFT\" ] || aws s3 sync \"$DRAFT\" \"$DRAFT_DIR\"; }"]
    env:
      - {name: TARGET, value: {{ $m.s3.target | quote }}}
      - {name: DRAFT, value: {{ ternary $m.s3.draft "" (eq (include "specdec.hasHead" .) "true") | quote }}}
      - {name: TARGET_DIR, value: {{ $paths.target | quote }}}
      - {name: DRAFT_DIR, value: {{ $paths.draft | quote }}}
      - {name: HOME, value: /tmp}
    {{- with $m.s3.credentialsSecret }}
    envFrom:
      - secretRef: {name: {{ . }}}
    {{- end }}
    securityContext: {{- toYaml $v.securityContext | nindent 6 }}
    volumeMounts:
      - {name: models, mountPath: /models}
      - {name: tmp, mountPath: /tmp}
  {{- end }}
{{- end }}
containers:
  - name: build-engine
    image: {{ include "specdec.image" . }}
    imagePullPolicy: {{ $v.imagePullPolicy }}
    command:
      - bash
      - -c
      - |
        set -o pipefail
        rm -f "$ENGINE.failed"
        specdec-build-engine "$@" 2>&1 | tee /tmp/build.log || { status=$?; tail -n 30 /tmp/build.log >"$ENGINE.failed"; exit "$status"; }
        {{- if gt (int $v.engine.cache.keepEngines) 0 }}
        # the engine is in place: this release's older engines (beyond keepEngines) and unlinked targets go
        specdec-engine-cache prune /engine-cache --release "$RELEASE" --engine "$ENGINE" --keep {{ $v.engine.cache.keepEngines }} || echo "engine cache: pruning failed; the engine is built"
        {{- end }}
      - specdec-build-engine
    args:
      - --draft={{ $v.engine.draft }}
      - --target={{ $paths.target }}
      {{- if eq (include "specdec.hasHead" .) "true" }}
      - --draft-path={{ $paths.draft }}
      {{- end }}
      - --backend={{ ternary "onnxruntime" $v.backend (eq $v.backend "embedded") }}
      - --tp={{ $v.parallelism.tensor }}
      - --pp={{ $v.parallelism.pipeline }}
      - --tree={{ $v.engine.tree }}
      {{- if eq $v.engine.tree "dynamic" }}
      - --total-tokens={{ $v.engine.totalTokens }}
      - --depth={{ $v.engine.depth }}
      - --top-k={{ $v.engine.topK }}
      {{- end }}
      {{- /* auto on a GPU backend: the checkpoint's precision, not what suits the CPU node the Job runs on */}}
      - --dtype={{ ternary "checkpoint" $v.engine.dtype (and (eq $v.engine.dtype "auto") (ne $v.backend "embedded")) }}
      - --output={{ $engine }}
      {{- if and $v.engine.cache.shareTargets (ne $v.backend "embedded") }}
      - --target-store=/engine-cache/targets
      {{- end }}
      {{- range $v.engine.buildArgs }}
      - {{ . | quote }}
      {{- end }}
    env:
      - {name: HOME, value: /tmp}
      - {name: ENGINE, value: {{ $engine | quote }}}
      - {name: RELEASE, value: {{ .Release.Name | quote }}}
    securityContext: {{- toYaml $v.securityContext | nindent 6 }}
    resources: {{- toYaml $v.engine.build.resources | nindent 6 }}
    volumeMounts:
      - {name: models, mountPath: /models, readOnly: {{ eq $m.source "pvc" }}}
      - {name: engine-cache, mountPath: /engine-cache}
      - {name: tmp, mountPath: /tmp}
volumes:
  - name: tmp
    emptyDir: {}
  - name: engine-cache
    persistentVolumeClaim: {claimName: {{ include "specdec.engineClaim" . }}}
  - name: models
    persistentVolumeClaim: {claimName: {{ include "specdec.modelClaim" . }}{{ if eq $m.source "pvc" }}, readOnly: true{{ end }}}
{{- end -}}

{{/* A Job's pod template cannot change: the name carries a hash of it, so changed build settings make a new Job (the
     builder reuses an engine already built from identical inputs, and a lock keeps two builds of one engine apart). */}}
{{- define "specdec.buildJobName" -}}
{{- printf "%s-build-%s" (include "specdec.fullname" . | trunc 45 | trimSuffix "-") (include "specdec.buildPodSpec" . | sha256sum | trunc 10) -}}
{{- end -}}
